"""python loo.py HELD OVERRIDES_JSON M... : Solin sequences but HELD streamed (as protocol 2), HELD held out;
in batches of $BATCH readings (default 50)"""
import os, sys, json, time, numpy as np
from gp_mapping.evaluation import calibration as C
from gp_mapping.evaluation.datasets import load_solin2018
held, over = int(sys.argv[1]), json.loads(sys.argv[2])
root = os.environ.get("GP_MAPPING_DATA", "../shared/data")
train = [s for s in (1, 2, 3, 4, 5) if s != held]
tr = [load_solin2018(root, s) for s in train]
te = load_solin2018(root, held)
rec = C.Recording(f"loo{held}", np.vstack([s.xy for s in tr]), np.concatenate([s.magnitude_uT for s in tr])[:, None],
                  te.xy, te.magnitude_uT[:, None], int(os.environ.get("BATCH", "50")), C.passes(*(s.t for s in tr)))
for m in [int(a) for a in sys.argv[3:]]:
    t0 = time.time()
    s = C.engine_scores(C.shipped(num_inducing=m, **over), rec)
    print(json.dumps(dict(over=over, name=f"loo{held}", m=m, batch=rec.batch,
                          rmse=round(s["rmse"], 4), nlpd=round(s["nlpd"], 4),
                          cov=round(s["within_2sd"], 3), z=round(s["z_std"], 3),
                          sec=round(time.time() - t0))), flush=True)
