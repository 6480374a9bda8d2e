"""Operator tools around the runtime, not part of it: bag replay as a camera (bag_replay, its bag readers in
bag_sources), the test camera, the action monitor, and the generator of the parameter docs (param_docs).
Runtime nodes live in vla_edge_ros/ros/; nothing there imports from here."""
