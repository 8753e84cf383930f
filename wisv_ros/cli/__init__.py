"""Command-line tools of wisv_ros (run with ``python -m wisv_ros.cli.<tool> --help``)."""
