"""The engines' settings (the ``model`` section of the configuration) and the rules that validate a setting.

Every field carries its allowed range or choices in its metadata (:func:`option`); :func:`section_from_dict`
builds a settings dataclass from a mapping and refuses unknown keys and bad values with a
:class:`~gp_mapping.gp.errors.ConfigError` naming the key. ``gp_mapping.config`` builds the whole YAML's sections
with the same rules and re-exports :class:`ModelConfig`. An engine's own settings are fields of
:class:`ModelConfig` (docs/adding_an_engine.md: how to add an engine).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError

#: model.mixing_learning choices (the continual_mogp engine reads them from here).
MIXING_LEARNING_CHOICES = ("first", "always", "never")
#: model.lengthscales choices (gp.kernels.lengthscale_groups says which axes share one).
LENGTHSCALE_CHOICES = ("isotropic", "horizontal", "per_axis")


def option(default, *, doc: str, low=None, high=None, low_open=False, choices=None, length=None, pattern=None,
           pattern_doc=None, increasing=False, max_length=None):
    """A dataclass field with its validation rule and its one-line documentation.

    ``choices`` lists the allowed strings; ``pattern`` (a regular expression, described by ``pattern_doc``)
    allows more strings beside them. ``length``: a list's length, or a tuple of allowed lengths (0 in it: an
    empty list is allowed, meaning "automatic"); ``increasing``: a list's entries must strictly increase;
    ``max_length``: a string's longest length."""
    meta = {"doc": doc, "low": low, "high": high, "low_open": low_open, "choices": choices, "length": length,
            "pattern": pattern, "pattern_doc": pattern_doc, "increasing": increasing, "max_length": max_length}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The GP engine (section ``model``)."""

    engine: str = option("dual_svgp", doc="GP engine: dual_svgp (memory-based dual SVGP, Chang et al. 2023; a vector "
                         "target gets independent latents sharing Z), continual_mogp (continual multi-output GP with a "
                         "linear model of coregionalisation, Moreno-Munoz et al. 2019) or smc_experts (sequential Monte "
                         "Carlo mixture of GP experts for nonstationary and changing fields, Zhang et al. 2019) or var_gp "
                         "(variational auto-regressive GP: region blocks of inducing points and a distribution over "
                         "the kernel hyperparameters, Kapoor et al. 2021; a vector target gets independent latents "
                         "sharing the blocks)",
                         choices=("dual_svgp", "continual_mogp", "smc_experts", "var_gp"))
    kernel: str = option("matern52", doc="stationary kernel", choices=("matern12", "matern32", "matern52", "rbf"))
    lengthscales: str = option("horizontal", doc="which input axes share a lengthscale: isotropic (one for all), "
                               "horizontal (x and y share one, the height of 3-D inputs has its own; the same as "
                               "isotropic in 2-D) or per_axis (ARD: one each). Per-axis lengthscales learned from "
                               "a robot driving parallel lanes collapse across the lanes and stripe the map",
                               choices=LENGTHSCALE_CHOICES)
    kernel_scales: int = option(2, doc="dual_svgp: the stationary kernel is a sum of this many, started at "
                                "lengthscales lengthscale * 2 ** (s - (S - 1) / 2) with the signal variance split "
                                "evenly, so a smooth trend and local detail each get their own (docs/calibration.md, "
                                "Several scales); 1: one kernel. continual_mogp spreads its latents' scales instead "
                                "(latent_lengthscale_ratio); var_gp has one", low=1, high=4)
    constant_kernel: bool = option(True, doc="add a learned constant (bias) kernel")
    calibration: str = option("prequential", doc="variance of a reading (what map.npz's reading_variance, "
                              "the localizer and NLPD use): prequential (each batch is predicted from the map as "
                              "it was calibration_lag metres of path earlier; from those out-of-sample errors "
                              "s^2 = w ((a + a_far r) * latent variance + noise, its floor's part times c, "
                              "+ b * slope^2 + tau^2), r the latent variance over the map's no-data variance, is "
                              "fitted by maximum likelihood: "
                              "docs/calibration.md) or none (latent variance + learned noise). Gaussian likelihood "
                              "only; the latent variance (~/variance) is never changed",
                              choices=("prequential", "none"))
    calibration_lag: float = option(5.0, doc="prequential calibration: each batch is predicted from the map as "
                                    "it was between one and two lags of this much path earlier (without the track "
                                    "that led to it, whose errors the batch shares: a new pass's prediction) [m]",
                                    low=0.0, low_open=True, high=1e6)
    calibration_slope: bool = option(True, doc="prequential calibration, dual_svgp: the variance of a reading at a "
                                     "reported position (a new pass; predict_reading, NLPD) also has a term "
                                     "b |grad m(x)|^2, the error a position off by b^(1/2) metres adds where the "
                                     "map is steep, with b fitted with the others on the out-of-sample errors. A "
                                     "reading taken exactly at x (the localizer, map.npz) has a fit of its own "
                                     "without it (docs/calibration.md, The slope term)")
    calibration_noise_factor: bool = option(False, doc="prequential calibration: let the records narrow the noise "
                                            "floor's part of a reading's variance by a factor c in [0.1, 1], as "
                                            "they always narrow model.time_error's shared error. Off by default: "
                                            "records made next to the path cannot see an error that returns with the "
                                            "heading (a sensor's offset), and on such a world c stated a reading's "
                                            "variance too narrow (0.75 within +-2 SD against 0.89 without; "
                                            "docs/calibration.md, The noise floor's part)")
    # 4096: 1024 fixed the simulated sim_revisit (its early records come from a map with far-off hyperparameters)
    # but left the localization bench's leave-one-out Solin maps at 0.61-0.71 within +-2 SD (0.85-0.92 at 4096)
    calibration_records: int = option(4096, doc="prequential calibration: out-of-sample errors kept (the most "
                                      "recent) to fit the variance model", low=1, high=1_000_000)
    spike_gate: float = option(6.0, doc="drop a reading (counted as dropped_spikes) that is farther than this many "
                               "predictive SDs of a reading from the readings both just before and just after it "
                               "(a magnetometer spike; a session's offset or a real edge of the field moves "
                               "neighbouring readings together and is kept: docs/calibration.md, Spikes); 0: off",
                               low=0.0, high=1e6)
    lengthscale: float = option(1.0, doc="initial lengthscale: the learned ones stay within about a factor of two "
                                "of it, so it acts as a prior; 1 m suits indoor fields by the worst case over the "
                                "calibration bench's recordings; set your field's scale if it differs "
                                "(docs/calibration.md, Where they start) [m]", low=0.0, low_open=True, high=1e4)
    signal_variance: float = option(1.0, doc="initial kernel variance (standardised targets)", low=0.0,
                                  low_open=True, high=1e4)
    constant_variance: float = option(1.0, doc="initial constant-kernel variance (standardised)", low=0.0,
                                    low_open=True, high=1e4)
    likelihood: str = option("gaussian", doc="observation model", choices=("gaussian", "student_t", "bernoulli"))
    noise_variance: float = option(0.01, doc="initial noise variance (standardised)", low=0.0, low_open=True,
                                 high=1e2)
    noise_floor: float = option(0.09, doc="gaussian likelihood: the least noise variance of a reading, in the "
                                "targets' units (uT^2 for a magnetometer in uT): the learned noise is this plus a "
                                "learned part. 0.09 = (0.3 uT)^2: a sensor's noise and the pose and orientation errors "
                                "that scatter readings at one place; keep it with a quieter sensor unless the "
                                "positions are exact too (docs/calibration.md, Noise floor)", low=0.0, high=1e4)
    position_noise: float = option(0.0, doc="dual_svgp, gaussian likelihood: the standard deviation of the error "
                                   "of the positions readings are placed with, on every input axis [m], where "
                                   "learning starts (learn_position_noise). A reading carries the map's slope times "
                                   "that error as noise of its own, position_noise^2 |grad m(x)|^2 (a noisy-input GP, "
                                   "McHutchon and Rasmussen 2011): readings where the field is steep count for less, "
                                   "so laps that disagree through their track's error are not mapped as detail. Set "
                                   "it to your localisation's error; 0: off, the default (on a simulated corridor "
                                   "it maps 16 % better, but on Solin a larger M maps worse with it: "
                                   "docs/calibration.md, Position noise)", low=0.0, high=1e2)
    learn_position_noise: bool = option(True, doc="dual_svgp with position_noise: learn the positions' error "
                                        "variance with the other hyperparameters, starting at position_noise "
                                        "(false: held at it)")
    time_error: bool = option(True, doc="dual_svgp, gaussian likelihood: each reading also carries an error that "
                              "neighbouring readings share, e(t), an Ornstein-Uhlenbeck process in the reading's "
                              "time (a track's pose error, an attitude error, a drift), learned with the other "
                              "hyperparameters from each batch's readings and their stamps; its variance adds to "
                              "each reading's noise and is held below what revisits show (readings of one place "
                              "on different passes, gp/revisits.py). On by default since 2026-12-02: by the "
                              "defaults table's worst case across recordings it maps better than white noise "
                              "alone (docs/calibration.md, Errors that neighbouring readings share). Other "
                              "engines and likelihoods have no error in time and leave it out; false: white "
                              "noise alone, the engine before 2026-12-02")
    error_variance: float = option(0.1, doc="time_error: initial variance of e(t) (standardised)", low=0.0,
                                   low_open=True, high=1e2)
    error_timescale: float = option(2.0, doc="time_error: initial timescale of e(t) [s]", low=0.0, low_open=True,
                                    high=1e6)
    correlated_folds: bool = option(True, doc="dual_svgp with time_error: readings folded into the old part "
                                    "together (a full update's leavers) are one site under e(t)'s covariance, so "
                                    "an error a pass shares counts once, not once per reading; only the part of e "
                                    "that revisits have shown is shared (none before they show it: a fold is "
                                    "final). On by default since 2026-12-03 (docs/calibration.md, A pass's error "
                                    "counted once); false: each reading's site on its own, with e's variance in "
                                    "its noise, the engine before")
    student_t_dof: float = option(4.0, doc="Student-t degrees of freedom", low=0.0, low_open=True, high=1e3)
    num_inducing: int = option(256, doc="number of inducing points M (var_gp: the most over all its blocks; "
                               "above it the oldest blocks are distilled)", low=1, high=8192)
    inducing: str = option("pivoted_cholesky", doc="inducing-point policy: re-selected by pivoted Cholesky "
                         "over [Z; X_new], or a fixed grid over inducing_bounds",
                         choices=("pivoted_cholesky", "grid"))
    inducing_bounds: list = option([-5.0, -5.0, 5.0, 5.0], doc="grid policy: [xmin, ymin, xmax, ymax] of the fixed "
                                 "inducing grid [m]", length=4)
    memory_size: int = option(500, doc="maximum number of past samples kept in memory", low=0, high=1_000_000)
    memory_per_batch: int = option(10, doc="samples drawn into memory from each batch", low=0, high=100_000)
    memory_selection: str = option("leverage", doc="how memory samples are drawn from a batch",
                                 choices=("leverage", "random"))
    rho: float = option(0.9, doc="natural-gradient damping step (non-Gaussian likelihoods: Gaussian sites are exact at once)", low=0.0, low_open=True, high=1.0)
    n_steps: int = option(2, doc="natural-gradient steps per full update (non-Gaussian likelihoods)", low=1, high=1000)
    learn_hyperparameters: bool = option(True, doc="learn kernel and noise hyperparameters online (full mode)")
    hyper_steps: int = option(20, doc="most Adam steps on the hyperparameters per full update (fewer by "
                                      "hyper_batch after the warm-up, or once a step gains less than hyper_tol; "
                                      "Adam's moments carry over between updates)", low=0, high=100_000)
    hyper_warmup: int = option(400, doc="dual_svgp and var_gp: a full update may take up to hyper_steps "
                                        "hyperparameter steps until the optimiser has taken this many in all (the map is small and the "
                                        "hyperparameters far off then); after that hyper_batch rules",
                               low=0, high=10_000_000)
    hyper_batch: int = option(50, doc="after the warm-up a full update takes one hyperparameter step per this "
                                      "many new samples (at least one, at most hyper_steps), so learning keeps "
                                      "pace with the data whatever full_update_every is, and a 1-second batch "
                                      "costs a step or two", low=1, high=1_000_000)
    # 1024: every held sample at the default memory (500) and batch. At 256 about half were left out of each step
    # and their sites frozen on u at the step's old hyperparameters: OptiTrack |B| settled at a 1.9 m lengthscale
    # and mapped at 0.99 uT (0.63 at 1024, exact GP 0.48); worst case over the calibration recordings in
    # docs/calibration.md. Costs about 1.5x the stream time of Solin protocol 2.
    hyper_points: int = option(1024, doc="dual_svgp and var_gp: hyperparameter steps see at most this many "
                                        "held samples (a uniform sample of the memory and of the batch; the "
                                        "rest's information stays in q, in the old data's pseudo-likelihood), so a "
                                        "step costs the same however large the batch", low=1, high=1_000_000)
    hyper_tol: float = option(1e-4, doc="stop a full update's hyperparameter steps when the objective per "
                                        "datum rose by less than this in the last step; 0: always hyper_steps",
                              low=0.0, high=1.0)
    hyper_objective: str = option("streaming", doc="dual_svgp: what the hyperparameter steps maximise. "
                                  "streaming: the streaming ELBO (Bui et al. 2017), each held datum once and the old "
                                  "data through their pseudo-likelihood on u; memory: the paper's dual-fixed "
                                  "objective, the memory scaled to stand for all old data (docs/calibration.md, "
                                  "Hyperparameter objective). With learn_inducing, memory",
                                  choices=("streaming", "memory"))
    hyper_lr: float = option(0.01, doc="Adam learning rate for the hyperparameters", low=0.0, low_open=True,
                           high=10.0)
    learn_inducing: bool = option(False, doc="move the inducing inputs by gradient steps on an ELBO that keeps the old "
                                "data's information (full mode; not for the grid policy). Opt-in: it helps on the Solin "
                                "recording and hurts on the demo bag (bench/README.md)")
    inducing_lr: float = option(0.01, doc="Adam learning rate for the inducing inputs [m per step]", low=0.0,
                              low_open=True, high=100.0)
    full_update_every: int = option(1, doc="every n-th update is a full update (memory, hyperparameters, "
                                  "inducing re-selection); the others are fast conditioning (dual_svgp: Z still "
                                  "grows, and a batch that leaves a full Z's cover gets a full update)", low=1, high=1_000_000)
    full_update_samples: int = option(150, doc="dual_svgp: an update that full_update_every makes full waits until "
                                    "at least this many samples have arrived since the last full update (this "
                                    "batch included), so the full-update cost per sample does not depend on the "
                                    "sensor rate or the batching (1: every scheduled update is full)",
                                    low=1, high=1_000_000_000)
    jitter: float = option(1e-6, doc="initial diagonal jitter added to K before Cholesky", low=0.0, high=1.0)
    device: str = option("auto", doc="torch device for the model: 'auto' (CUDA when available), 'cpu', 'cuda' or "
                         "'cuda:N' (GPU N)", choices=("auto", "cpu", "cuda"), pattern=r"cuda:[0-9]+",
                         pattern_doc="'cuda:N'")
    seed: int = option(0, doc="random seed (memory sampling, initial mixing weights)", low=0, high=2**31 - 1)
    num_latents: int = option(3, doc="continual_mogp: number Q of latent GPs mixed into the output channels",
                            low=1, high=64)
    latent_lengthscale_ratio: float = option(2.0, doc="continual_mogp: latent q starts at lengthscale * ratio ** "
                                           "(q - (Q - 1) / 2), so the latents cover several scales (1: all equal)",
                                           low=1.0, high=100.0)
    vem_iterations: int = option(4, doc="continual_mogp: variational EM iterations (M-step of hyper_steps Adam "
                               "steps, inducing inputs re-placed, E-step) per full update", low=1, high=1000)
    mixing_learning: str = option("first", doc="continual_mogp: when the mixing weights are learned: only while a "
                                "channel is first seen (no forgetting through them), in every full update (as "
                                "the paper), or never", choices=MIXING_LEARNING_CHOICES)
    variational_steps: int = option(100, doc="continual_mogp, non-Gaussian likelihoods: Adam steps on q(u) per "
                                  "E-step (a Gaussian likelihood has a closed-form E-step)", low=1, high=100_000)
    variational_lr: float = option(0.02, doc="continual_mogp (non-Gaussian likelihoods) and var_gp: Adam learning "
                                   "rate on q(u)",
                                 low=0.0, low_open=True, high=10.0)
    smc_particles: int = option(16, doc="smc_experts: number J of particles (partitions of the data into experts)",
                              low=1, high=100_000)
    smc_max_experts: int = option(32, doc="smc_experts: most experts per particle (when all are in use no new one "
                                "opens; with gate_on_time the most faded one joins its neighbour to free a slot)", low=1, high=4096)
    smc_expert_memory: int = option(64, doc="smc_experts: most pseudo-observations per expert (exact GP on them); "
                                  "when full, the closest pair is merged", low=2, high=4096)
    smc_niw_psi: float = option(1.0, doc="smc_experts: gating NIW prior scale Psi0 = smc_niw_psi * I [input units^2]; "
                              "the prior mean covariance of an expert's inputs is Psi0 / (dof - D - 1)",
                              low=0.0, low_open=True, high=1e12)
    smc_niw_dof: float = option(5.0, doc="smc_experts: gating NIW prior degrees of freedom nu0 (must exceed "
                              "input_dims - 1)", low=0.0, low_open=True, high=1e6)
    smc_niw_prior_count: float = option(0.5, doc="smc_experts: gating NIW prior count lambda0 on the expert's mean",
                                      low=0.0, low_open=True, high=1e6)
    smc_gate_prior_mean: str = option("local", doc="smc_experts: NIW prior mean of an expert's inputs: at the input "
                                    "that opens it (local: any place can open an expert, for maps that grow) or "
                                    "at the origin (zero: for standardised inputs, as in the paper's experiments)",
                                    choices=("local", "zero"))
    smc_gate: str = option("kernel", doc="smc_experts: the gate, the density of an expert's inputs: niw (a Normal-"
                         "inverse-Wishart cluster, the paper's) or kernel (a Gaussian kernel of width "
                         "smc_gate_bandwidth around each of its readings, a distance-dependent CRP: an expert "
                         "claims the places where its readings are, whatever their shape; a full expert with short "
                         "lengthscale is then split in two instead of merging readings)",
                         choices=("niw", "kernel"))
    smc_gate_bandwidth: float = option(0.3, doc="smc_experts with smc_gate kernel: the most width of the kernel "
                                     "around each reading [input units], about the spacing of neighbouring tracks; "
                                     "an expert's own width is half its lengthscale along each axis below that, so a sharp "
                                     "expert claims only the places its readings determine (whether a place is mapped at all "
                                     "is still decided at this width)",
                                     low=0.0, low_open=True, high=1e6)
    smc_target_scaling: str = option("running", doc="smc_experts: the experts' targets: readings less their running "
                                   "mean, scaled by their running spread (running: for maps, whose level is not known "
                                   "in advance), or as given (none: zero-mean experts on targets standardised "
                                   "beforehand, as in the paper's experiments)", choices=("running", "none"))
    smc_alpha_shape: float = option(1.0, doc="smc_experts: Gamma prior shape a0 of the DP concentration alpha",
                                  low=0.0, low_open=True, high=1e6)
    smc_alpha_rate: float = option(1.0, doc="smc_experts: Gamma prior rate b0 of alpha", low=0.0, low_open=True,
                                 high=1e6)
    smc_hyper_prior_std: float = option(1.0, doc="smc_experts: standard deviation of the log-normal prior of each "
                                      "expert's hyperparameters (medians: lengthscale, signal_variance, "
                                      "noise_variance, constant_variance)", low=0.0, low_open=True, high=100.0)
    smc_slice_steps: int = option(1, doc="smc_experts: elliptical slice sampling transitions per update for each "
                                "expert that received data (0: hyperparameters stay at their draws)", low=0, high=1000)
    smc_slice_experts: int = option(2, doc="smc_experts: at most this many experts per particle (those that received "
                                  "the most readings) have their hyperparameters moved per update", low=0, high=4096)
    smc_ess_threshold: float = option(0.5, doc="smc_experts: resample when the effective sample size falls below "
                                    "this fraction of the particles", low=0.0, high=1.0)
    smc_resampling: str = option("systematic", doc="smc_experts: resampling scheme (multinomial as in the paper, "
                               "or systematic: lower variance)", choices=("systematic", "multinomial"))
    smc_proposal: str = option("adapted", doc="smc_experts: how a reading picks its expert: from the gate alone "
                             "(prior, as in the paper) or from the gate times the expert's predictive density "
                             "of the reading (adapted: readings that disagree with an expert open a new one)",
                             choices=("adapted", "prior"))
    gate_on_time: bool = option(False, doc="smc_experts: where experts overlap, the gate prefers the one with the "
                              "more recent readings there (time scale smc_time_scale), so a field that changed gets a "
                              "new expert and the map prefers it; a place not driven since stays mapped")
    smc_time_scale: float = option(300.0, doc="smc_experts with gate_on_time: decay time of an expert's recency; "
                                 "two experts at one place whose readings are dt apart are weighed e^(dt / scale) "
                                 "to 1 [s of sample stamps]", low=0.0, low_open=True, high=1e9)
    vargp_block_size: int = option(64, doc="var_gp: most inducing points in one region block (at most half of "
                                   "num_inducing: distillation merges two blocks into one)", low=1, high=4096)
    vargp_new_block: float = option(0.01, doc="var_gp: a new block is opened when, after the current block is full, "
                                    "a batch input keeps more than this fraction of its prior variance given all "
                                    "blocks' inducing inputs", low=0.0, low_open=True, high=1.0)
    vargp_neighbours: int = option(4, doc="var_gp: a block is conditioned on this many nearest earlier blocks "
                                   "(bounded cost); 0: on all earlier blocks, as in the paper", low=0, high=4096)
    vargp_beta: float = option(1.0, doc="var_gp: tempering factor beta of KL[q_t(theta) || q_t-1(theta)]",
                               low=0.0, high=1e6)
    vargp_hyper_prior_std: float = option(1.0, doc="var_gp: standard deviation of the log-normal prior of each "
                                          "kernel hyperparameter, centred on the configured value (q(theta) "
                                          "starts at the same centre, narrower: 0.05)", low=0.0, low_open=True, high=100.0)
    vargp_samples: int = option(2, doc="var_gp: draws of q(theta) per hyperparameter step (2: an antithetic pair)",
                                low=1, high=64)
    vargp_predict_samples: int = option(4, doc="var_gp: fixed draws of q(theta) that a prediction averages "
                                        "(1: the mean)", low=1, high=64)
    vargp_revisits: str = option("freeze", doc="var_gp, Gaussian likelihood: readings where the current block has "
                                 "almost no say (a revisit of frozen regions) also refine the frozen blocks there by "
                                 "streaming Bayes, adding their information (refine), or leave them as they are "
                                 "(freeze, the paper's frozen blocks)",
                                 choices=("refine", "freeze"))
    vargp_block_memory: int = option(1024, doc="var_gp: most samples of the current block's data kept for its "
                                     "bound (a uniform weighted sample above it)", low=1, high=1_000_000)
    tile_size: float = option(12.0, doc="local submaps: side of the square tiles, centred on the map origin, that "
                              "each hold their own engine with num_inducing points, so a map grows at constant cost "
                              "(docs/large_areas.md); a room within 5 m of the origin stays in one tile and maps as "
                              "one engine. smc_experts and var_gp cover a growing map their own way and are not "
                              "tiled; 0: one global engine [m]", low=0.0, high=1e5)
    tile_overlap: float = option(2.0, doc="tiles: width of the band around a tile border where two tiles share the "
                                 "data and their maps are blended; at most tile_size (and tile_height) [m]", low=0.0,
                                 low_open=True, high=1e5)
    tile_height: float = option(0.0, doc="tiles with 3-D inputs: side of the tiles in z (several storeys); 0: tiles "
                                "span all heights [m]", low=0.0, high=1e5)
    tile_consensus_step: float = option(0.0, doc="tiles: how far the shared hyperparameters go from the tiles' "
                                        "sample-weighted average of their latest proposals towards the proposal of "
                                        "the tile just updated, scaled by that tile's samples over a typical "
                                        "tile's (0: the average, which moves by about one tile's steps per lap over "
                                        "twenty tiles, so revisits teach the tiles slowly; 1: that proposal, as one "
                                        "engine learns). At 0.5 the simulated corridor maps 1.57 against 1.69 uT "
                                        "and the simulated worlds' NLPD is 0.02-0.03 nats worse: 0 by the worst "
                                        "case (docs/calibration.md, Tile consensus)", low=0.0, high=1.0)


def describe_allowed(meta: Mapping[str, Any], ftype: str) -> str:
    """Human-readable allowed values of a field (used in error messages and ROS parameter descriptors)."""
    if meta.get("choices"):
        names = [repr(c) for c in meta["choices"]] + ([meta["pattern_doc"]] if meta.get("pattern_doc") else [])
        return "one of " + ", ".join(names)
    if meta.get("length"):
        lengths = meta["length"] if isinstance(meta["length"], tuple) else (meta["length"],)
        text = " or ".join(f"{n} finite numbers" for n in lengths if n)
        text = f"a list of {text}" + (", strictly increasing" if meta.get("increasing") else "")
        if meta.get("low") is not None or meta.get("high") is not None:
            text += f", each in {'(' if meta.get('low_open') else '['}{meta.get('low')}, {meta.get('high')}]"
        return ("an empty list (automatic) or " + text) if 0 in lengths else text
    if meta.get("max_length"):
        return f"a string of at most {meta['max_length']} characters"
    low, high = meta.get("low"), meta.get("high")
    if low is not None or high is not None:
        left = "(" if meta.get("low_open") else "["
        return f"{'an integer' if ftype == 'int' else 'a number'} in {left}{low}, {high}]"
    return f"a {ftype}"


def validate_value(key: str, value: Any, f: dataclasses.Field) -> Any:
    """Return ``value`` converted to the field's type, or raise ConfigError naming ``key``."""
    meta, ftype = f.metadata, f.type if isinstance(f.type, str) else f.type.__name__
    allowed = describe_allowed(meta, ftype)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{why}; allowed: {allowed}", key)

    if ftype == "bool":
        if not isinstance(value, bool):
            raise refuse(f"{value!r} is not a boolean")
        return value
    if ftype == "str":
        if not isinstance(value, str):
            raise refuse(f"{value!r} is not a string")
        if meta.get("choices") and value not in meta["choices"] \
                and not (meta.get("pattern") and re.fullmatch(meta["pattern"], value)):
            raise refuse(f"{value!r} is not allowed")
        if meta.get("max_length") and len(value) > meta["max_length"]:
            raise refuse(f"a string of {len(value)} characters is too long")
        return value
    if ftype == "list":
        lengths = meta["length"] if isinstance(meta["length"], tuple) else (meta["length"],)
        if value is None and 0 in lengths:  # ROS hands an empty array in a parameter file as "not set"
            value = []
        if not isinstance(value, (list, tuple)) or len(value) not in lengths:
            raise refuse(f"{value!r} is not a list of length {' or '.join(map(str, lengths))}")
        out = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise refuse(f"{value!r} holds a non-finite or non-numeric entry")
            out.append(float(v))
        if meta.get("increasing") and any(b <= a for a, b in zip(out, out[1:])):
            raise refuse(f"{value!r} does not strictly increase")
        low, high = meta.get("low"), meta.get("high")
        if any((low is not None and (v < low or (meta.get("low_open") and v == low))) or (high is not None and v > high)
               for v in out):
            raise refuse(f"{value!r} holds an entry out of range")
        return out
    if ftype == "int":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise refuse(f"{value!r} is not an integer")
        value = int(value)
    elif ftype == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(f"{value!r} is not a number")
        value = float(value)
        if not math.isfinite(value):
            raise refuse(f"{value!r} is not finite")
    low, high = meta.get("low"), meta.get("high")
    if low is not None and (value < low or (meta.get("low_open") and value == low)):
        raise refuse(f"{value!r} is too small")
    if high is not None and value > high:
        raise refuse(f"{value!r} is too large")
    return value


def section_from_dict(cls, values: Mapping[str, Any], prefix: str = ""):
    """Build one section dataclass from a mapping, refusing unknown keys and bad values (keys named
    ``prefix`` + field name in the errors)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    values = _renamed_keys(cls, values, prefix)
    for key, value in values.items():
        if key not in fields:
            where = f" in '{prefix.rstrip('.')}'" if prefix else ""
            raise ConfigError(f"known keys{where}: {', '.join(sorted(fields))}", prefix + key, unknown=True)
        kwargs[key] = validate_value(prefix + key, value, fields[key])
    return cls(**kwargs)


def _renamed_keys(cls, values: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """Keys of earlier versions, translated so their config files and saved maps still load: model.ard (a bool)
    became model.lengthscales (true: per_axis, false: isotropic)."""
    if cls is not ModelConfig or "ard" not in values:
        return values
    values = dict(values)
    ard = values.pop("ard")
    if not isinstance(ard, bool):
        raise ConfigError(f"{ard!r} is not a boolean (model.ard is now model.lengthscales)", prefix + "ard")
    if "lengthscales" in values:
        raise ConfigError("both model.ard and model.lengthscales are set; model.ard is the old name: remove it",
                          prefix + "ard")
    values["lengthscales"] = "per_axis" if ard else "isotropic"
    return values


__all__ = ["LENGTHSCALE_CHOICES", "MIXING_LEARNING_CHOICES", "ConfigError", "ModelConfig", "describe_allowed",
           "option", "section_from_dict", "validate_value"]
