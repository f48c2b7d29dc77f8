"""Plain-Python install of oxygen_ros (model, engine, benchmark) for machines without ROS.

On a ROS 2 machine the package is built with colcon from CMakeLists.txt, which also generates
the oxygen_ros.msg interfaces. `pip install .` installs the same Python sources without them;
the ROS node modules import rclpy only when they run.
"""
from setuptools import find_packages, setup

setup(
    name='oxygen_ros',
    version='0.1.0',
    description='pi0.5 vision-language-action inference with unified KV cache management',
    license='Apache-2.0',
    python_requires='>=3.10',
    packages=find_packages(include=['oxygen_ros', 'oxygen_ros.*']),
    package_data={'oxygen_ros.model': ['configs/*.yaml']},
    install_requires=[
        'torch>=2.4',
        'numpy',
        'safetensors',
        'sentencepiece',
        'PyYAML',
        'matplotlib',
        'tqdm',
    ],
    entry_points={
        'console_scripts': [
            'oxygen-bench = oxygen_ros.bench.engine:main',
            # The MuJoCo ALOHA and its evaluation need requirements-mujoco.txt (and ROS).
            'oxygen-eval = oxygen_ros.sim.eval:main',
            'oxygen_mujoco_aloha = oxygen_ros.sim.mujoco_aloha:main',
            # Needs requirements-mujoco.txt and h5py.
            'oxygen-demos = oxygen_ros.sim.demos:main',
            'oxygen-train = oxygen_ros.sim.train:main',
            # Needs rosbags (requirements-distro.txt) and h5py; not ROS.
            'oxygen-replay = oxygen_ros.robot.replay:main',
        ],
    },
)
