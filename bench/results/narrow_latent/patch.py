"""python patch.py SCRIPT ARGS...: run one of the bench scripts (../hyper_inducing/lad2.py, loo.py, var2.py) with
the calibration's least factor a on the latent variance taken from $SCALE_LO (gp/calibration.py SCALE_BOUNDS, whose
low end is 1: the calibration never narrows the latent variance); with $ANCHOR set, a below 1 narrows the latent
variance near data only (anchor.py); with $SHARED_FULL set, the calibration's factor c leaves the variance of the
error shared in time (model.time_error) whole (it scales the floor's part alone, under
model.calibration_noise_factor)."""
import os
import runpy
import sys

import gp_mapping.gp.calibration as K

if "SCALE_LO" in os.environ:
    K.SCALE_BOUNDS = (float(os.environ["SCALE_LO"]), K.SCALE_BOUNDS[1])
if os.environ.get("SHARED_FULL"):
    def _floor_part_alone(self):
        return self.shared_var * 0.0 + (self.noise_floor if self.noise_factor else 0.0)
    K.PrequentialCalibration._scaled_noise = _floor_part_alone
for flag, module in (("ANCHOR", "anchor"), ("FARTHER", "farther")):
    if os.environ.get(flag):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        __import__(module)  # patches PrequentialCalibration on import
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
