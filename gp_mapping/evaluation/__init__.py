"""The gp_mapping benchmark harness (``gp-mapping bench [--quick]``, or ``python -m bench.harness``).

Not part of the installed package: it lives in the source tree beside ``gp_mapping/`` and reads the real
recordings from ``../shared/data`` (or ``$GP_MAPPING_DATA``) and the shipped ``config/mapper.yaml``.

* :mod:`bench.accuracy`: the two streaming protocols on the Solin et al. (2018) recording, engines against
  baselines (offline SVGP, exact GP, Bui et al. 2017, nearest neighbour, constant mean), per-batch RMSE/NLPD.
* :mod:`bench.speed`: update latency and grid prediction time of the engine over M (from
  :mod:`bench.bench_engine`), replay real-time factors, and the CUDA section.
* :mod:`bench.growth`: cost as the stream grows (one-hour simulated drive through the Mapper).
* :mod:`bench.harness`: runs the sections, writes ``bench.json``, ``bench.md`` and the PNG curves.
"""
