"""vla_edge_ros.ros: the thin rclpy layer (nodes, runtime, launch helpers). Everything else imports without rclpy."""
import os

# One BLAS thread per process, set before numpy is imported by any node module (this package __init__ runs
# first). The tiny default's matrices are small: a second OpenBLAS thread buys nothing and, on 2 shared cores,
# its spin-waiting made chunks 2x slower at the median and 6x at p99 (measured with the numpy backend under
# load: p50 26 -> 58 ms, p99 37 -> 241 ms). An explicit setting by the user wins.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
del _var
