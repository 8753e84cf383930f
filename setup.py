"""pip install route for the wisv_ros Python package (the interfaces are built by CMake).

tools/setup.sh builds msg/ and action/ with CMake into the venv, then installs this package
editable. colcon builds the package with CMakeLists.txt instead and ignores this file.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

PACKAGE_NAME = "wisv_ros"
HERE = Path(__file__).resolve().parent
# One version for package.xml, setup.py and wisv_ros.__version__ (test_interfaces.py checks).
VERSION = re.search(r"<version>([^<]+)</version>", (HERE / "package.xml").read_text()).group(1)

setup(
    name=PACKAGE_NAME,
    version=VERSION,
    packages=find_packages(include=[PACKAGE_NAME, PACKAGE_NAME + ".*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + PACKAGE_NAME]),
        ("share/" + PACKAGE_NAME, ["package.xml"]),
    ],
    python_requires=">=3.10",
    # The runtime dependencies (rclpy comes from the ROS 2 install, not from pip). tools/setup.sh pins
    # their versions (tools/requirements.txt: torch must be the CPU build there) and installs this
    # package with --no-deps; llama-cpp-python is built by its step `engine`.
    install_requires=["numpy", "pyyaml", "torch", "transformers", "gguf", "onnx", "onnxruntime", "rosbags",
                      "llama-cpp-python"],
    zip_safe=False,
    license="Apache-2.0",
    description="Wireless speculative verification over ROS 2",
    entry_points={
        "console_scripts": [
            "drafter_node = wisv_ros.nodes.drafter_node:main",
            "verifier_node = wisv_ros.nodes.verifier_node:main",
            "link_emulator_node = wisv_ros.nodes.link_emulator_node:main",
            "link_monitor_node = wisv_ros.nodes.link_monitor_node:main",
        ]
    },
)
