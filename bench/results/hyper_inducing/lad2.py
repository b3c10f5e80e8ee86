"""python lad2.py NAME OVERRIDES_JSON M... -> one JSON line per M: a calibration-section recording streamed by the
shipped dual_svgp with the overrides, scored on its held-out pass (the largest tile's lengthscales and white noise)."""
import json
import os
import sys
import time

from gp_mapping.evaluation import calibration as C

name, over = sys.argv[1], json.loads(sys.argv[2])
rec = C.load(name, os.environ.get("GP_MAPPING_DATA", "../shared/data"), {})
for m in [int(a) for a in sys.argv[3:]] or [256]:
    t0 = time.time()
    s = C.engine_scores(C.shipped(num_inducing=m, **over), rec, keep_model=True)
    model = s.pop("model")
    tiles = getattr(model, "tiles", None)
    eng = max((t.engine for t in tiles.values()), key=lambda e: e.num_seen) if tiles else model
    ls = [round(float(v), 3) for k in eng.kernel.modules()
          if isinstance(getattr(type(k), "lengthscale", None), property) for v in k.lengthscale.detach().flatten()]
    noise = float(eng.likelihood.noise_variance.detach().flatten()[0] * eng.y_std.flatten()[0] ** 2)
    print(json.dumps(dict(over=over, name=name, m=m, rmse=round(s["rmse"], 4), nlpd=round(s["nlpd"], 4),
                          cov=round(s["within_2sd"], 3), z=round(s["z_std"], 3), noise=round(noise, 4), ls=ls,
                          sec=round(time.time() - t0))), flush=True)
