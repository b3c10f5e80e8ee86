"""python lad2.py NAME OVERRIDES_JSON M... -> one json line per M"""
import os, sys, time, json, numpy as np, torch
from gp_mapping.evaluation import calibration as C
name, over = sys.argv[1], json.loads(sys.argv[2])
ms = [int(a) for a in sys.argv[3:]] or [256]
rec = C.load(name, os.environ.get("GP_MAPPING_DATA", "../shared/data"), {})
for m in ms:
    t0 = time.time()
    s = C.engine_scores(C.shipped(num_inducing=m, **over), rec, keep_model=True)
    model = s.pop("model")
    eng = max([sl.engine for sl in model.tiles.values()], key=lambda e: e.num_seen) if hasattr(model, "tiles") else model
    ls = [round(float(v), 3) for k in eng.kernel.modules() if isinstance(getattr(type(k), "lengthscale", None), property) for v in k.lengthscale.detach().flatten()]
    row = dict(over=over, name=name, m=m, rmse=round(s["rmse"], 4), nlpd=round(s["nlpd"], 4), cov=round(s["within_2sd"], 3),
               z=round(s["z_std"], 3), noise=round(float(eng.likelihood.noise_variance.flatten()[0] * eng.y_std.flatten()[0]**2), 4), ls=ls, sec=round(time.time() - t0))
    print(json.dumps(row), flush=True)
