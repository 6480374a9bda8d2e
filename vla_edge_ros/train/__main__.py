"""``python -m vla_edge_ros.train`` = ``vla_train``."""
import sys

from vla_edge_ros.train.cli import main

sys.exit(main())
