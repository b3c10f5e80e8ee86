"""python var2.py VARIANT OVERRIDES_JSON M... (the variants section's seeds)"""
import sys, json, time
from gp_mapping.evaluation import calibration as C, variants as V
name, over = sys.argv[1], json.loads(sys.argv[2])
seed = 100 * (list(V.VARIANTS).index(name) + 1)
rec = V.recording(name, seed=seed)
for m in [int(a) for a in sys.argv[3:]]:
    t0 = time.time()
    s = C.engine_scores(C.shipped(num_inducing=m, **over), rec)
    print(json.dumps(dict(over=over, name=name, m=m, rmse=round(s["rmse"], 4), nlpd=round(s["nlpd"], 4),
                          cov=round(s["within_2sd"], 3), z=round(s["z_std"], 3),
                          sec=round(time.time() - t0))), flush=True)
