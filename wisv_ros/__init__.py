"""wisv_ros: wireless speculative verification over ROS 2.

The core modules are pure Python (no rclpy import here). The generated interfaces live in
``wisv_ros.msg`` and ``wisv_ros.action``; depending on the install route they sit in another
folder of the same name (site-packages or a colcon install space), so the package path is
extended to every ``wisv_ros`` folder on ``sys.path``.
"""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)

__version__ = "0.1.0"
