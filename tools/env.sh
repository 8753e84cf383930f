# Environment for running wisv_ros from this checkout; source it (tools/setup.sh builds .venv).
#   source tools/env.sh
# Activates .venv (ROS 2 kilted wheels, torch, the generated wisv_ros.msg/.action). The wisv_ros
# package itself is installed editable, so it is imported from this checkout.

_wisv_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ ! -f "$_wisv_root/.venv/bin/activate" ]]; then
  echo "env.sh: $_wisv_root/.venv missing; run: bash tools/setup.sh" >&2
  unset _wisv_root
  return 1 2>/dev/null || exit 1
fi
# shellcheck disable=SC1091
source "$_wisv_root/.venv/bin/activate"
export WISV_ROOT="$_wisv_root"
# Keep DDS discovery on this machine unless the caller chose otherwise.
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
# rclpy and the generated interfaces are found through the venv prefix.
case ":${AMENT_PREFIX_PATH:-}:" in
  *":$VIRTUAL_ENV:"*) ;;
  *) export AMENT_PREFIX_PATH="$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}" ;;
esac
unset _wisv_root
