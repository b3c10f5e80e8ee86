"""Evaluation: the reference predictors, the loaders of the real recordings, and the benchmark harness
(``gp-mapping bench [--quick]``), installed with the package so that the bench runs from any install; the real
recordings are found through ``--data`` or ``$GP_MAPPING_DATA`` (:func:`gp_mapping.evaluation.datasets.shared_data_root`).

* :mod:`~gp_mapping.evaluation.baselines`: nearest neighbour, constant mean, offline SVGP and exact GP (GPyTorch),
  and Bui et al. (2017) streaming sparse GP, the references the engines are measured against.
* :mod:`~gp_mapping.evaluation.datasets`: the Solin et al. (2018) and Osman et al. (2021) recordings.
* :mod:`~gp_mapping.evaluation.accuracy`: the two streaming protocols on the Solin et al. (2018) recording, engines
  against baselines (offline SVGP, exact GP, Bui et al. 2017, nearest neighbour, constant mean), per-batch RMSE/NLPD.
* :mod:`~gp_mapping.evaluation.speed`: update latency and grid prediction time of the engine over M (from
  :mod:`~gp_mapping.evaluation.bench_engine`), replay real-time factors, and the CUDA section.
* :mod:`~gp_mapping.evaluation.growth`: cost as the stream grows (one-hour simulated drive through the Mapper).
* :mod:`~gp_mapping.evaluation.harness`: runs the sections, writes ``bench.json``, ``bench.md`` and the PNG curves
  (``bench/results`` of a source checkout by default; ``bench/README.md`` explains every number).
"""
