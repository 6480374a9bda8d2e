"""vla_edge_ros."""
