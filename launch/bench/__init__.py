"""Code the scripts in ``launch/`` share (benchmarks, main-job training scripts, the convergence sweep).

A script run as ``python launch/<script>.py`` has ``launch/`` first on ``sys.path``, so it imports this
package as ``bench`` (``from bench.common import ...``) with no path manipulation.
"""
