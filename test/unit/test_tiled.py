"""Local submaps (gp/tiles/): tile geometry, tiles against one global engine, seams, state round trips,
bad input, both engines, 3-D tiles.

Data: a simulated 8 m x 8 m world with 20 dipoles (gp_mapping.sim), a lawnmower 0.8 m between lanes at 1 m/s,
|B| in microtesla (std about 3.4 uT over the path). Measured when written: one global dual SVGP (M = 128) scores
0.075 uT RMSE on held-out points along the path, 12 tiles of 4 m (overlap 2 m, M = 64 each) 0.071 uT, and
the two maps differ by 0.025 uT RMS. The bounds below leave a factor of about 3.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gp_mapping.config import ConfigError, ModelConfig, config_from_dict
from gp_mapping.gp import GPNumericalError, ModelInputError, TiledModel, build_model
from gp_mapping.gp.tiles import TileLayout, smootherstep, tile_key
from gp_mapping.mapping.mapper import Mapper
from gp_mapping.mapping.state import MapStateError
from gp_mapping.sim import SensorConfig, TrajectoryConfig, WorldConfig, simulate

torch.set_num_threads(1)
AREA = (0.0, 0.0, 8.0, 8.0)


@pytest.fixture(scope="module")
def drive():
    rec = simulate(WorldConfig(area=AREA, n_dipoles=20),
                   TrajectoryConfig(patterns=("lawnmower",), area=AREA, line_spacing=0.8, speed=1.0, duration=90.0,
                                    rate=10.0), SensorConfig(), seed=1)
    return rec


def samples(rec, dims=2):
    x = rec.sensor_position[:, :dims]
    y = np.linalg.norm(rec.field_sensor_tesla, axis=1)[:, None] * 1e6
    return x, y


def held_out(rec, dims=2):
    pts = rec.sensor_position[::7].copy()
    pts[:, :2] += 0.05
    truth = rec.world.magnitude(pts) * 1e6
    return pts[:, :dims], truth


def model_config(**kw) -> ModelConfig:
    base = dict(num_inducing=64, memory_size=200, hyper_steps=10, device="cpu", lengthscale=1.0, tile_size=4.0,
                full_update_every=1,
                tile_overlap=2.0)
    base.update(kw)
    return ModelConfig(**base)


def stream(model, x, y, batch=50):
    for i in range(0, len(x), batch):
        model.update(x[i:i + batch], y[i:i + batch])
    return model


# ----------------------------------------------------------------------------------------------- geometry

@pytest.mark.parametrize("sizes", [(4.0, 4.0), (4.0, 4.0, 2.5)])
def test_weights_are_a_partition_of_unity_on_the_tiles_that_hold_the_point(sizes):
    layout = TileLayout(sizes, 2.0)
    x = torch.as_tensor(np.random.default_rng(0).uniform(-13, 13, (5000, len(sizes))))
    pts, tiles, w = layout.blend(x)
    total = torch.zeros(len(x), dtype=torch.float64).index_add_(0, pts, w)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-12)
    mp, mt = layout.memberships(x)
    members = {(int(p), tuple(t.tolist())) for p, t in zip(mp, mt)}
    assert {(int(p), tuple(t.tolist())) for p, t in zip(pts, tiles)} <= members
    for p, t in list(members)[:500]:  # membership = the point lies in the tile's span
        for (lo, hi), v in zip(layout.span(t), x[p].tolist()):
            assert lo <= v < hi


def test_a_point_goes_to_one_tile_in_a_core_two_in_a_band_four_at_a_corner_eight_in_3d():
    layout = TileLayout((4.0, 4.0), 2.0)
    x = torch.tensor([[2.0, 2.0], [4.5, 2.0], [3.5, 4.2]], dtype=torch.float64)
    pts, _ = layout.memberships(x)
    assert torch.bincount(pts).tolist() == [1, 2, 4]
    pts, _ = TileLayout((4.0, 4.0, 3.0), 2.0).memberships(torch.tensor([[3.5, 4.2, 3.1]], dtype=torch.float64))
    assert len(pts) == 8


@pytest.mark.parametrize("dims", [2, 3])
def test_grouping_of_rows_by_tile_matches_torch_unique(dims):
    gen = torch.Generator().manual_seed(dims)
    tiles = torch.randint(-7, 9, (500, dims), generator=gen)
    keys, inverse = torch.unique(tiles, dim=0, return_inverse=True)
    groups = TileLayout.group(tiles)
    assert [index for index, _ in groups] == [tuple(k) for k in keys.tolist()]
    for u, (_, rows) in enumerate(groups):
        assert torch.equal(rows, torch.nonzero(inverse == u, as_tuple=True)[0])
    assert TileLayout.group(tiles[:0]) == []


def test_blending_weight_is_smooth_across_a_border():
    layout = TileLayout((4.0, 4.0), 2.0)
    xs = torch.linspace(2.0, 6.0, 4001, dtype=torch.float64)
    x = torch.stack([xs, torch.full_like(xs, 2.0)], 1)
    pts, tiles, w = layout.blend(x)
    w0 = torch.zeros(len(xs), dtype=torch.float64).index_add_(0, pts[tiles[:, 0] == 0], w[tiles[:, 0] == 0])
    assert float(w0[xs <= 3.0].min()) == 1.0 and float(w0[xs >= 5.0].max()) == 0.0
    assert float(torch.diff(w0).abs().max()) < 2e-3  # max slope 15/8 per m of smootherstep over 2 m: 1.9e-3
    u = torch.linspace(0, 1, 101, dtype=torch.float64)
    assert torch.allclose(smootherstep(u) + smootherstep(1 - u), torch.ones_like(u), atol=1e-14)


def test_overlap_wider_than_a_tile_is_refused_by_name():
    with pytest.raises(ConfigError, match="tile_overlap"):
        build_model(model_config(tile_overlap=5.0), 2, 1)
    with pytest.raises(ConfigError, match="tile_overlap"):
        config_from_dict({"model": {"tile_overlap": 0.0}})
    with pytest.raises(ConfigError, match="tile_size"):
        config_from_dict({"model": {"tile_size": -1.0}})


# ----------------------------------------------------------------------------------------------- accuracy

def test_tiles_match_one_global_model_on_a_small_area(drive):
    """9 tiles of M = 64 against one engine with M = 128 over 8 m x 8 m: the two maps differ by less than the
    global map's own error (0.10 against 0.12 uT RMS, 3 % of the field's spread over the path), and the tiled
    map is no worse than 1.2 x the global one's RMSE."""
    x, y = samples(drive)
    test_x, truth = held_out(drive)
    glob = stream(build_model(dataclasses.replace(model_config(), tile_size=0.0, num_inducing=128), 2, 1), x, y)
    tiled = stream(build_model(model_config(), 2, 1), x, y)
    assert isinstance(tiled, TiledModel) and tiled.num_tiles >= 9
    mg = glob.predict(test_x)[0].numpy()[:, 0]
    mt, vt = (t.numpy()[:, 0] for t in tiled.predict(test_x))
    rmse_g = float(np.sqrt(np.mean((mg - truth) ** 2)))
    rmse_t = float(np.sqrt(np.mean((mt - truth) ** 2)))
    assert float(np.sqrt(np.mean((mt - mg) ** 2))) < rmse_g
    assert rmse_t < 1.2 * rmse_g, (rmse_t, rmse_g)
    assert np.all(vt > 0) and np.all(np.isfinite(vt))
    lpd = tiled.log_predictive_density(test_x, truth[:, None]).numpy()
    assert np.all(np.isfinite(lpd))
    assert tiled.num_seen == len(x)


def _tile_mean(tiled, index, pts):
    with tiled._hyperparameters(tiled.tiles["_".join(map(str, index))].theta):
        return tiled.tile(index).predict(pts)[0].numpy()[:, 0]


def test_no_seam_across_tile_borders(drive):
    """Grid lines (0.1 m cells) across the borders x = 4 and y = 4, over the driven area. (1) The mean's jump
    between the two cells either side of a border is no larger than the largest jump between neighbouring
    cells inside the tiles' cores. (2) No step: a step shows as a jump that differs from the mean of its two
    neighbours' jumps; in the border bands that deviation stays within its largest value in the cores. The
    two tiles' own maps do differ at the borders (by up to ~0.4 uT here): switching from one to the other at
    the border instead of blending fails (2) by a factor > 5."""
    x, y = samples(drive)
    tiled = stream(build_model(model_config(), 2, 1), x, y)
    res = 0.1
    ts = np.arange(0.55, 7.45, res)
    mid = 0.5 * (ts[1:] + ts[:-1])
    border_pair = int(np.argmin(np.abs(mid - 4.0)))
    band = np.abs(mid[1:-1] - 4.0) <= 1.0
    core = (np.abs(mid[1:-1] - 2.0) <= 1.0) | (np.abs(mid[1:-1] - 6.0) <= 1.0)

    def step(m):
        d = np.diff(m)
        return d, np.abs(d[1:-1] - 0.5 * (d[:-2] + d[2:]))

    border_jumps, core_jumps, band_steps, core_steps, hard_steps = [], [], [], [], []
    for axis in (0, 1):
        for c in np.arange(1.0, 7.5, 0.8):  # along the lanes (y = const) and across them
            line = np.zeros((len(ts), 2))
            line[:, axis] = ts
            line[:, 1 - axis] = c
            d, s = step(tiled.predict(line)[0].numpy()[:, 0])
            border_jumps.append(abs(d[border_pair]))
            core_jumps.append(np.abs(d[1:-1][core]).max())
            band_steps.append(s[band].max())
            core_steps.append(s[core].max())
            other = 0 if c < 4 else 1
            a, b = [(0, other), (1, other)] if axis == 0 else [(other, 0), (other, 1)]
            hard = np.where(ts < 4.0, _tile_mean(tiled, a, line), _tile_mean(tiled, b, line))
            hard_steps.append(step(hard)[1][band].max())
    assert max(border_jumps) <= max(core_jumps)
    assert max(band_steps) <= max(core_steps)
    assert max(hard_steps) > 5 * max(core_steps)


# ----------------------------------------------------------------------------------------------- state

@pytest.mark.parametrize("position_noise", [0.0, 0.05])
def test_state_dict_round_trip_with_any_number_of_tiles(drive, position_noise):
    """Also with position noise, whose learned variance the tiles share like the kernel's hyperparameters."""
    x, y = (a[::2] for a in samples(drive))
    cfg = model_config(position_noise=position_noise)
    a = stream(build_model(cfg, 2, 1), x[:150], y[:150])
    few = {k: v.clone() for k, v in a.state_dict().items()}
    stream(a, x[150:], y[150:])
    if position_noise:
        shared = a.prior.position_param
        assert a.num_tiles > 1 and all(t.engine.position_param is shared for t in a.tiles.values())
        assert abs(float(shared.value.detach()) - position_noise ** 2) > 1e-5  # learned
    else:
        assert not hasattr(a.prior, "position_param")
    b = build_model(cfg, 2, 1)
    b.load_state_dict(a.state_dict())  # an empty model takes every tile
    assert b.tile_indices() == a.tile_indices()
    test_x, truth = held_out(drive)
    for ta, tb in zip(a.predict(test_x), b.predict(test_x)):
        assert torch.equal(ta, tb)
    for ta, tb in zip(a.predict_reading(test_x), b.predict_reading(test_x)):
        assert torch.equal(ta, tb)
    # Continuing from the copy gives bit-identical maps (stale tiles carry their own hyperparameters). A reading's
    # variance is refitted on records the copy makes without the original's lagged map (not part of a saved state:
    # it calibrates again after two lags, gp/calibration.py), and since the calibration's a_far follows the records
    # it differs by a little.
    more_x, more_y = x[::3] + 0.02, y[::3]
    stream(a, more_x, more_y)
    stream(b, more_x, more_y)
    for ta, tb in zip(a.predict(test_x), b.predict(test_x)):
        assert torch.equal(ta, tb)
    (mean_a, var_a), (mean_b, var_b) = a.predict_reading(test_x), b.predict_reading(test_x)
    assert torch.equal(mean_a, mean_b)
    torch.testing.assert_close(var_a, var_b, rtol=0.02, atol=0.0)
    # A state with fewer tiles loaded into a model with more: the extra tiles go.
    b.load_state_dict(few)
    assert b.num_tiles < a.num_tiles and b.num_seen == 150
    c = build_model(cfg, 2, 1)
    c.load_state_dict(few)
    for tb, tc in zip(b.predict(test_x), c.predict(test_x)):
        assert torch.equal(tb, tc)


def test_one_tile_maps_bit_for_bit_as_one_engine(drive):
    """A map that stays in one tile's core (tiles centred on the origin) is the engine's own map: the shared
    hyperparameters are that tile's, and its target unit adapts by the single engine's rule."""
    x, y = samples(drive)
    x = (x - 4.0) * 0.5  # the 8 m x 8 m drive shrunk into the core of tile 0 of 12 m tiles: [-4, 4]
    test_x, truth = held_out(drive)
    test_x = (test_x - 4.0) * 0.5
    rest = np.repeat(x[:1], 60, 0), y[:1] + np.random.default_rng(0).normal(0, 0.01, (60, 1))  # rescaled later
    engine = build_model(model_config(tile_size=0.0), 2, 1)
    tiled = build_model(model_config(tile_size=12.0), 2, 1)
    for model in (engine, tiled):
        stream(model, *rest)
        stream(model, x[:400], y[:400])
    assert tiled.num_tiles == 1 and int(tiled.rescalings_t) >= 1 and engine.rescalings >= 1
    for a, b in zip(engine.predict(test_x), tiled.predict(test_x)):
        assert torch.equal(a, b)


def test_shared_hyperparameters_are_the_sample_weighted_mean_of_the_tiles_proposals(drive):
    """With model.tile_consensus_step 0, after a tile learns, the shared hyperparameters are
    sum_t n_t theta_t / sum_t n_t over the tiles' latest proposals (between learning updates they stay put: a fast
    update moves no tile's theta)."""
    x, y = samples(drive)
    model = stream(build_model(model_config(tile_consensus_step=0.0), 2, 1), x[:400], y[:400])
    stats = model.update(x[400:450], y[400:450], mode="full")
    assert stats["hyper_steps"] > 0
    slots = list(model.tiles.values())
    n = torch.tensor([float(s.engine.num_seen) for s in slots], dtype=torch.float64)
    thetas = torch.stack([s.theta for s in slots])
    assert len(slots) > 3 and len({tuple(t.tolist()) for t in thetas}) > 1
    assert torch.allclose(model._theta(), (n[:, None] * thetas).sum(0) / n.sum(), rtol=0, atol=1e-12)
    # A state saved before the running sums were kept recounts them from its tiles.
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("consensus_")}
    again = build_model(model_config(tile_consensus_step=0.0), 2, 1)
    again.load_state_dict(state)
    assert torch.allclose(again.consensus_sum, model.consensus_sum, rtol=1e-12, atol=0)
    assert float(again.consensus_weight) == float(model.consensus_weight) == float(n.sum())
    assert float(again.consensus_tiles) == float(model.consensus_tiles) == len(slots)
    # One saved with the sums but before the tiles were counted counts them from its tiles.
    state = {k: v for k, v in model.state_dict().items() if k != "consensus_tiles"}
    again = build_model(model_config(tile_consensus_step=0.0), 2, 1)
    again.load_state_dict(state)
    assert float(again.consensus_tiles) == len(slots)


@pytest.mark.parametrize("step", [0.5, 1.0])
def test_a_consensus_step_moves_the_shared_hyperparameters_towards_the_latest_proposal(drive, step):
    """model.tile_consensus_step: the shared hyperparameters are avg + s (theta_last - avg), avg the
    sample-weighted mean of the tiles' latest proposals, theta_last the proposal of the tile that learned last and
    s the step scaled by that tile's samples over a typical tile's (sum_t n_t over the tiles with samples), at
    most 1."""
    x, y = samples(drive)
    model = stream(build_model(model_config(tile_consensus_step=step), 2, 1), x[:400], y[:400])
    assert model.update(x[400:450], y[400:450], mode="full")["hyper_steps"] > 0
    average = model.consensus_sum / model.consensus_weight
    typical = float(model.consensus_weight) / float(model.consensus_tiles)
    assert float(model.consensus_tiles) == model.num_tiles  # every tile has samples
    slots = list(model.tiles.values())
    assert len(slots) > 3
    moved = [average + step * min(1.0, float(slot.engine.num_seen) / typical) * (slot.theta - average)
             for slot in slots]
    assert any(torch.allclose(model._theta(), theta, rtol=0, atol=1e-10) for theta in moved)
    assert not torch.allclose(model._theta(), average, rtol=0, atol=1e-6)


def test_a_tile_with_few_samples_moves_the_consensus_in_proportion(drive):
    """The step towards a proposal is scaled by the proposing tile's samples over a typical tile's: a new tile's
    first readings (which its first steps fit with a noise at the floor) cannot pull the shared hyperparameters
    far."""
    x, y = samples(drive)
    model = stream(build_model(model_config(tile_consensus_step=0.5), 2, 1), x[:400], y[:400])
    average = model.consensus_sum / model.consensus_weight
    typical = float(model.consensus_weight) / float(model.consensus_tiles)
    proposal = average + 1.0
    few = model._consensus(proposal, 0.1 * typical)
    many = model._consensus(proposal, 3.0 * typical)
    assert torch.allclose(few, average + 0.05, rtol=0, atol=1e-12)
    assert torch.allclose(many, average + 0.5, rtol=0, atol=1e-12)


def test_the_lagged_copy_holds_the_tiles_near_the_path(drive):
    """The calibration's lagged copy of a tiled map copies only the tiles within 2 calibration_lag + tile_overlap
    of the last reading (what the next two lags of path can reach), so its cost does not grow with the map."""
    x, y = samples(drive)
    model = stream(build_model(model_config(calibration_lag=0.25, tile_overlap=0.5), 2, 1), x[:400], y[:400])
    near = model.tiles_near_path()
    here = model.calibration.last_x.tolist()
    reach = 2 * 0.25 + model.layout.overlap
    for index in model.tile_indices():
        lo_hi = model.layout.span(index)
        gap = float(np.sqrt(sum(max(lo - p, 0.0, p - hi) ** 2 for (lo, hi), p in zip(lo_hi, here))))
        assert (tile_key(index) in near) == (gap <= reach)
    assert 0 < len(near) < model.num_tiles
    assert set(model._snapshot().tiles.keys()) == near


def test_a_state_saved_before_centred_tiles_keeps_its_lattice(drive):
    """States saved before 2026-11-26 have no lattice_centred: their tiles were cornered on the origin (tile 0
    spanned [-o/2, s + o/2)), and they load so, with the tiles' unit taken from the running statistics."""
    x, y = samples(drive)
    model = stream(build_model(model_config(), 2, 1), x[:300], y[:300])
    assert model.layout.centred and model.layout.span((0, 0))[0] == (-3.0, 3.0)  # s = 4, o = 2
    legacy = {k: v for k, v in model.state_dict().items()
              if k not in ("lattice_centred", "scale_offset", "scale_std", "scale_set", "rescalings_t", "target_moved")
              and not k.endswith(".y_moved")}
    old = build_model(model_config(), 2, 1)
    old.load_state_dict(legacy)
    assert not old.layout.centred and old.layout.span((0, 0))[0] == (-1.0, 5.0)
    assert bool(old.scale_set) and torch.equal(old.scale_offset, old.target_mean)
    # saved before the moments counted moving data only: what they counted stands for moving data
    assert bool(old.target_moved) and all(bool(slot.engine.y_moved) for slot in old.tiles.values())
    x_new = torch.as_tensor(x[300:350])
    assert {tuple(t) for t in old.layout.memberships(x_new)[1].tolist()} != \
        {tuple(t) for t in model.layout.memberships(x_new)[1].tolist()}
    old.update(x[300:350], y[300:350])  # and it goes on mapping
    assert np.all(np.isfinite(old.predict(x[:50])[0].numpy()))


def test_warm_up_belongs_to_the_shared_hyperparameters(drive):
    """model.hyper_warmup counts the steps of all tiles together: once they have taken it, every tile -- a
    new one included -- takes the post-warm-up budget (one step per hyper_batch new samples), so an update
    costs the same in the hundredth tile as in the second (a tile's own count would restart the warm-up).
    hyper_batch here exceeds any tile's batch and pending samples together: one step per full tile update. With
    position noise, which a tile's first update cannot learn (no map, no slope yet): it has no gradient then,
    and the optimiser's state is still stored (Engine._store_adam: zero moments for it, the others' moments and
    the step count kept; before, nothing was stored, and the tiles' counts summed to 12 of the 46 steps taken)."""
    x, y = samples(drive)
    cfg = model_config(hyper_steps=10, hyper_warmup=30, hyper_batch=1000, hyper_tol=0.0, position_noise=0.05)
    model = build_model(cfg, 2, 1)
    young, grown = [], []
    for i in range(0, len(x), 50):
        was_young = model.hyperparameters_young
        before = model.num_tiles
        stats = model.update(x[i:i + 50], y[i:i + 50])
        (young if was_young else grown).append((stats, model.num_tiles - before))
    assert not model.hyperparameters_young and int(model.hyper_steps_t) >= 30
    assert max(s["hyper_steps"] for s, _ in young) > 2  # the warm-up takes up to hyper_steps per tile
    # After it: at most one step per touched tile, new tiles too.
    assert all(s["hyper_steps"] <= s["tiles_touched"] for s, _ in grown)
    assert any(made for _, made in grown)
    # A state saved before the count existed loads with the tiles' own step counts summed.
    state = {k: v for k, v in model.state_dict().items() if k != "hyper_steps_t"}
    again = build_model(cfg, 2, 1)
    again.load_state_dict(state)
    total = sum(int(model.tile(i).adam_step) for i in model.tile_indices())
    assert int(again.hyper_steps_t) == total == int(model.hyper_steps_t)


def test_an_update_touches_only_the_tiles_its_batch_falls_in(drive):
    """The same batch on the same map, once with all its tiles and once with only the tiles the batch falls in:
    bit-identical tiles afterwards, and the other tiles' own state unchanged (the cost cannot depend on them; the
    bench section 'large' times it)."""
    x, y = samples(drive)
    model = stream(build_model(model_config(), 2, 1), x[:500], y[:500])
    bx, by = x[500:550], y[500:550]
    _, members = model.layout.memberships(torch.as_tensor(bx))
    touched = {"_".join(map(str, row)) for row in members.tolist()}
    assert 0 < len(touched) < model.num_tiles - 3
    state = {k: v.clone() for k, v in model.state_dict().items()}
    few = {k: v for k, v in state.items() if not k.startswith("tiles.") or k.split(".", 2)[1] in touched}
    other = build_model(model_config(), 2, 1)
    other.load_state_dict(few)
    model.update(bx, by)
    other.update(bx, by)
    after, after_few = model.state_dict(), other.state_dict()
    for k, v in after.items():
        if k.startswith("calibration."):  # the calibration predicts from a lagged copy that a loaded map lacks
            continue
        if not k.startswith("tiles.") or k.split(".", 2)[1] in touched:
            assert torch.equal(v, after_few[k]), k
        elif k.split(".")[2:4] not in (["engine", "kernel"], ["engine", "likelihood"],
                                       ["engine", "position_param"]):  # shared: the consensus
            assert torch.equal(v, state[k]), k


def test_mapper_checkpoint_round_trip_and_grid_with_tiles(drive, tmp_path):
    cfg = config_from_dict({"model": dataclasses.asdict(model_config(hyper_steps=5)),
                            "batching": {"size": 50},
                            "grid": {"resolution": 0.2, "margin": 0.5, "unknown_distance": 0.3}})
    rec = drive
    n = len(rec.t)
    mapper = Mapper(cfg)
    for i in range(n // 2):
        mapper.add_pose(float(rec.t[i]), rec.position[i], rec.orientation_xyzw[i])
        mapper.add_magnetic_field(float(rec.t[i]), rec.field_sensor_tesla[i])
        mapper.process()
    path = tmp_path / "tiles.safetensors"
    mapper.save(path)
    loaded = Mapper.load(path, cfg)
    assert loaded.model.num_tiles == mapper.model.num_tiles > 1
    for m in (mapper, loaded):
        for i in range(n // 2, n):
            m.add_pose(float(rec.t[i]), rec.position[i], rec.orientation_xyzw[i])
            m.add_magnetic_field(float(rec.t[i]), rec.field_sensor_tesla[i])
            m.process()
        m.flush()
    # Another tile geometry would put the saved tiles in the wrong places: refused by name.
    other = config_from_dict({"model": dataclasses.asdict(model_config(hyper_steps=5, tile_size=5.0))})
    with pytest.raises(MapStateError, match="tile_size"):
        Mapper.load(path, other)
    ga, gb = mapper.grid(full=True), loaded.grid(full=True)
    for name in ga.layers:
        np.testing.assert_array_equal(ga.layers[name][0], gb.layers[name][0])
        np.testing.assert_array_equal(ga.layers[name][1], gb.layers[name][1])
    mean, var = ga.layers["magnitude"]
    assert np.all(np.isfinite(mean)) and np.all(var >= 0)
    truth = rec.world.magnitude(np.column_stack([*(a.ravel() for a in np.meshgrid(
        ga.spec.column_centres(), ga.spec.row_centres())), np.zeros(mean.size)])).reshape(mean.shape) * 1e6
    known = ga.known
    rmse = float(np.sqrt(np.mean((mean[known] - truth[known]) ** 2)))
    assert rmse < 0.5, rmse  # |B| spreads ~3.4 uT over the area
    assert mapper.diagnostics()["num_seen"] == mapper.diagnostics()["accepted"]


# ----------------------------------------------------------------------------------------------- bad input

def test_bad_input_is_refused_and_leaves_the_model_unchanged(drive):
    x, y = samples(drive)
    model = stream(build_model(model_config(), 2, 1), x[:200], y[:200])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad_x = x[200:250].copy()
    bad_x[7, 0] = np.nan
    with pytest.raises(ModelInputError):
        model.update(bad_x, y[200:250])
    bad_y = y[200:250].copy()
    bad_y[3, 0] = np.inf
    with pytest.raises(ModelInputError):
        model.update(x[200:250], bad_y)
    with pytest.raises(ModelInputError):
        model.update(x[200:250], y[200:249])
    with pytest.raises(ModelInputError):
        model.predict(np.array([[np.inf, 1.0]]))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_bad_messages_are_refused_and_counted_as_without_tiles(drive):
    """The same stream with NaN, zero and absurd readings and a NaN pose mixed in: each refused under its
    reason, and the tiled map bit-identical to the map of the clean stream."""
    cfg = config_from_dict({"model": dataclasses.asdict(model_config(hyper_steps=3)), "batching": {"size": 50}})
    rec = drive
    maps = []
    for bad in (False, True):
        mapper = Mapper(cfg)
        for i in range(300):
            t = float(rec.t[i])
            mapper.add_pose(t, rec.position[i], rec.orientation_xyzw[i])
            mapper.add_magnetic_field(t, rec.field_sensor_tesla[i])
            if bad and i % 50 == 7:
                mapper.add_magnetic_field(t + 0.001, [np.nan, 1e-5, 1e-5])
                mapper.add_magnetic_field(t + 0.002, [0.0, 0.0, 0.0])
                mapper.add_magnetic_field(t + 0.003, [1.0, 0.0, 0.0])
                mapper.add_pose(t + 0.01, [np.nan, 0.0, 0.0], rec.orientation_xyzw[i])
            mapper.process()
        maps.append(mapper)
    clean, dirty = maps
    rejected = dirty.diagnostics()["rejected"]
    for reason in ("field_nonfinite", "field_zero", "field_out_of_range", "pose_nonfinite"):
        assert rejected[reason] == 6, (reason, rejected)
    assert sum(clean.diagnostics()["rejected"].values()) == 0
    assert clean.model.num_tiles > 1 and clean.model.num_seen == dirty.model.num_seen
    test_x, _ = held_out(drive)
    for a, b in zip(clean.model.predict(test_x), dirty.model.predict(test_x)):
        assert torch.equal(a, b)


def test_a_tile_that_fails_numerically_is_rolled_back_and_counted_by_the_mapper(drive, monkeypatch):
    """A batch over a border whose second tile fails: the Mapper counts the failure and drops the batch, the
    first tile's update and any tile created by the batch are undone, later batches map on."""
    cfg = config_from_dict({"model": dataclasses.asdict(model_config(hyper_steps=3)), "batching": {"size": 50}})
    mapper = Mapper(cfg)
    x, y = samples(drive)
    model = mapper.model
    stream(model, x[:100], y[:100])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tiles_before = model.tile_indices()
    calls = {"n": 0}
    original = type(model.prior).update

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise GPNumericalError("simulated Cholesky failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model.prior), "update", flaky)
    far = np.column_stack([np.linspace(3.0, 5.0, 50), np.full(50, 20.0)])  # two new tiles across x = 4
    from gp_mapping.mapping.measurements import Measurements
    batch = Measurements(far, y[:50], np.arange(50.0), np.column_stack([far, np.zeros(50)]))
    assert mapper._update(batch) is None
    assert mapper.failed_updates == 1 and mapper.dropped_failed_update == 50
    assert model.tile_indices() == tiles_before
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    monkeypatch.setattr(type(model.prior), "update", original)
    assert mapper._update(batch) is not None and model.num_tiles > len(tiles_before)


# ----------------------------------------------------------------------------------------------- incremental maps

def test_changed_since_names_the_points_of_the_tiles_an_update_touched(drive):
    """After a batch in one tile's core, only points blending that tile (or the prior, which every update may
    move) have changed; a tile that appears changes the points of its span; a rollback or a load changes
    everything (its versions are new)."""
    x, y = samples(drive)
    model = stream(build_model(model_config(), 2, 1), x[:600], y[:600])
    probe = torch.as_tensor(np.stack(np.meshgrid(np.arange(0.5, 7.5, 0.25), np.arange(0.5, 7.5, 0.25)),
                                     axis=-1).reshape(-1, 2))
    versions = model.prediction_versions()
    assert not model.changed_since(probe, versions).any()
    core = np.random.default_rng(0).uniform(3.2, 4.8, (40, 2))  # in tile (1, 1)'s core, [3, 5]^2
    assert model.layout.memberships(torch.as_tensor(core))[1].unique(dim=0).tolist() == [[1, 1]]
    before = model.predict(probe)
    model.update(core, np.full((40, 1), float(y.mean())))
    changed = model.changed_since(probe, versions).numpy()
    pts, tiles, _ = model.layout.blend(probe)
    in_touched = np.zeros(len(probe), dtype=bool)
    in_touched[pts[(tiles == torch.tensor([1, 1])).all(1)].numpy()] = True
    blends_prior = np.zeros(len(probe), dtype=bool)
    missing = [tile_key(tuple(t)) not in model.tiles for t in tiles.tolist()]
    blends_prior[pts[torch.tensor(missing)].numpy()] = True
    np.testing.assert_array_equal(changed, in_touched | blends_prior)
    assert changed.sum() > 0 and (~changed).sum() > 100
    after = model.predict(probe)
    for a, b in zip(before, after):  # the points it calls unchanged predict exactly what they did
        np.testing.assert_array_equal(a[~changed].numpy(), b[~changed].numpy())
    model.begin_update()
    model.update(np.array([[30.0, 30.0]]), np.array([[float(y.mean())]]))  # a new tile far away
    assert model.changed_since(torch.tensor([[30.0, 30.0]]), versions).all()
    versions = model.prediction_versions()
    model.rollback()
    assert model.changed_since(probe, versions).all()
    versions = model.prediction_versions()
    model.load_state_dict(model.state_dict())
    assert model.changed_since(probe, versions).all()


@pytest.mark.parametrize("tile_size, device", [(2.0, "cpu"), (0.0, "cpu"),
                                               pytest.param(2.0, "cuda", marks=pytest.mark.gpu)])
def test_an_incremental_map_equals_a_whole_draw_and_repredicts_only_what_changed(drive, tile_size, device):
    """Publications draw incrementally (Mapper.grid(incremental=True)). Along a drive whose 6 m window rolls over
    tiles of 2 m, drawn after every update and between updates, the map equals a whole draw of the same state:
    the same known cells, mean and variance to round-off. After an update it re-predicts the cells of the tiles
    the update touched (some of the window, never more than a whole draw); without tiles, every cell. Between
    updates only the cells the rolling window newly covers are predicted, none when it did not move; after
    mark_changed every cell. On a GPU (the tiles' versions and the kept draw on the device) the same."""
    cfg = config_from_dict({"model": dataclasses.asdict(model_config(hyper_steps=3, tile_size=tile_size,
                                                                     tile_overlap=1.0, device=device)),
                            "batching": {"size": 50},
                            "grid": {"resolution": 0.1, "margin": 0.5, "unknown_distance": 0.5, "window": [6.0, 6.0]}})
    mapper = Mapper(cfg)
    assert mapper.model.device.type == device
    rows = {"n": 0}
    predict = mapper.model.predict

    def counted(x):
        rows["n"] += x.shape[0]
        return predict(x)

    def draw(**kwargs):
        mapper.model.predict = counted
        rows["n"] = 0
        try:
            return mapper.grid(predict_unknown=False, **kwargs), rows["n"]
        finally:
            mapper.model.predict = predict

    rec = drive
    after_update, between = [], []  # (rows predicted incrementally, rows of a whole draw)
    origins = set()
    for i in range(len(rec.t)):
        mapper.add_pose(float(rec.t[i]), rec.position[i], rec.orientation_xyzw[i])
        mapper.add_magnetic_field(float(rec.t[i]), rec.field_sensor_tesla[i])
        updated = bool(mapper.process())
        if not mapper.updates or not (updated or i % 5 == 0):
            continue
        grid, n_incremental = draw(incremental=True)
        whole, n_whole = draw()
        (after_update if updated else between).append((n_incremental, n_whole))
        origins.add((grid.spec.origin_x, grid.spec.origin_y))
        assert grid.spec == whole.spec
        np.testing.assert_array_equal(grid.known, whole.known)
        mean, var = grid.layers["magnitude"]
        whole_mean, whole_var = whole.layers["magnitude"]
        np.testing.assert_array_equal(np.isnan(mean), ~whole.known)
        np.testing.assert_allclose(mean[whole.known], whole_mean[whole.known], rtol=0, atol=1e-9)
        np.testing.assert_allclose(var[whole.known], whole_var[whole.known], rtol=0,
                                   atol=1e-9 * float(np.max(whole_var[whole.known])))
    assert len(after_update) >= 15 and len(between) >= 100 and len(origins) > 10  # the window rolled
    assert all(inc <= whole for inc, whole in after_update)
    if tile_size > 0:
        assert sum(inc < whole for inc, whole in after_update) >= len(after_update) // 2
    else:
        assert all(inc == whole for inc, whole in after_update)
    assert sum(inc for inc, _ in between) < 0.1 * sum(whole for _, whole in between)
    assert draw(incremental=True)[1] == 0  # nothing changed, the window did not move
    mapper.mark_changed()
    grid, n = draw(incremental=True)
    assert n == int(grid.known.sum())
    mapper.reset()
    assert mapper.grid(predict_unknown=False, incremental=True) is None


# ----------------------------------------------------------------------------------------------- engines, 3-D

def test_continual_mogp_tiles_map_the_vector_field(drive):
    x = drive.sensor_position[:, :2]
    y = drive.field_map_tesla_true * 1e6 + np.random.default_rng(0).normal(0, 0.1, (len(x), 3))
    cfg = model_config(engine="continual_mogp", num_inducing=24, hyper_steps=5, vem_iterations=1,
                       full_update_every=4)
    model = stream(build_model(cfg, 2, 3), x[:500], y[:500], batch=100)
    assert model.num_tiles > 1 and not model.prior.mixing_raw.requires_grad
    test_x = x[:500:9] + 0.03
    truth = drive.world.field(np.column_stack([test_x, np.zeros(len(test_x))])) * 1e6
    mean, var = model.predict(test_x)
    assert np.sqrt(np.mean((mean.numpy() - truth) ** 2)) < 1.5  # per-component spread ~3 uT
    copy = build_model(cfg, 2, 3)
    copy.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.predict(test_x), copy.predict(test_x)))


def test_3d_inputs_tiled_in_height(drive):
    """Two storeys 3 m apart (tile_height 3): samples of each storey go to its own tiles; the upper storey's
    map is not pulled towards the lower one's."""
    x2, y = samples(drive)
    lower = np.column_stack([x2, np.zeros(len(x2))])
    upper = np.column_stack([x2, np.full(len(x2), 3.2)])
    cfg = model_config(tile_height=3.0, tile_overlap=1.0, num_inducing=40, hyper_steps=5)
    model = build_model(cfg, 3, 1)
    assert model.layout.dims == 3
    both_x = np.vstack([lower[::3], upper[1::3]])
    both_y = np.vstack([y[::3], y[1::3] + 10.0])  # the upper storey reads 10 uT more
    order = np.random.default_rng(0).permutation(len(both_x))
    stream(model, both_x[order], both_y[order], batch=100)
    assert {i[2] for i in model.tile_indices()} == {0, 1}  # tiles centred on z = 0: one storey in each core
    test_x, truth = held_out(drive)
    lo = model.predict(np.column_stack([test_x, np.zeros(len(test_x))]))[0].numpy()[:, 0]
    hi = model.predict(np.column_stack([test_x, np.full(len(test_x), 3.2)]))[0].numpy()[:, 0]
    assert np.sqrt(np.mean((lo - truth) ** 2)) < 0.5
    assert np.sqrt(np.mean((hi - truth - 10.0) ** 2)) < 0.5


@pytest.mark.gpu
def test_tiles_on_cuda_match_the_cpu(drive):
    """The same stream on the GPU (float64) and the CPU: the same tiles and maps within 1e-6 uT."""
    x, y = (a[:300] for a in samples(drive))
    cpu = stream(build_model(model_config(hyper_steps=3), 2, 1), x, y)
    gpu = stream(build_model(model_config(hyper_steps=3, device="cuda"), 2, 1), x, y)
    assert gpu.device.type == "cuda" and gpu.tile_indices() == cpu.tile_indices()
    test_x, _ = held_out(drive)
    for a, b in zip(cpu.predict(test_x), gpu.predict(test_x)):
        assert b.device.type == "cuda"
        np.testing.assert_allclose(b.cpu().numpy(), a.numpy(), atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
def test_a_tiled_map_on_cuda_goes_in_parts_that_merge_with_a_tile_cache_as_its_whole_summary(drive):
    """What a GPU robot's ~/model does with a large tiled map (mapping/merge.py): parts of its tiles, put together,
    merged with a tile cache (cold, then every tile reused), equal the merge of its whole summary, and merging
    the one map gives back its mean (its variance away from all tiles follows the merged consensus kernel)."""
    from gp_mapping.mapping.merge import (MapSource, TileRotation, assemble_tiles, decode_summary, encode_summary,
                                          merge_maps, tile_summary_bytes)

    cfg = config_from_dict({"model": {"num_inducing": 32, "device": "cuda", "tile_size": 4.0, "tile_overlap": 1.0,
                                      "hyper_steps": 3}, "batching": {"size": 50}})
    x, y = samples(drive)
    mapper = Mapper(cfg, model=stream(build_model(cfg.model, 2, 1), x[:600], y[:600]))
    assert mapper.model.device.type == "cuda" and mapper.model.num_tiles > 2
    sizes, tiles = tile_summary_bytes(mapper.model), mapper.model.tile_samples()
    rotation, held = TileRotation(), None
    while held is None or held.missing_tiles:
        part = rotation.choose(tiles, sizes, 2 * max(sizes.values()))
        held = assemble_tiles(held, decode_summary(encode_summary(MapSource.from_mapper("A", mapper, tiles=part)),
                                                   10**8))
        rotation.sent(part, tiles)
    cache = {}
    cold, first = merge_maps([held], tile_cache=cache)
    warm, again = merge_maps([held], tile_cache=cache)
    whole, _ = merge_maps([MapSource.from_mapper("A", mapper)])
    assert first.reused == 0 and again.reused == again.tiles == mapper.model.num_tiles
    test_x, _ = held_out(drive)
    for merged in (cold, warm):
        for a, b in zip(merged.model.predict(test_x), whole.model.predict(test_x)):
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(whole.model.predict(test_x)[0].cpu(), mapper.model.predict(test_x)[0].cpu(),
                               rtol=1e-9, atol=1e-9)


def test_a_map_of_one_tile_summarises_as_its_engine_and_a_map_of_several_has_no_single_summary(drive):
    """Merging maps (gp/merging/) takes a map of one tile as its engine's summary; overlapping tiles share
    their bands' data, so a map of several tiles has no single summary (a MergeError says why): it merges tile
    by tile (the tests below)."""
    from gp_mapping.gp.merging import MergeError

    x, y = samples(drive)
    x = (x - 4.0) * 0.5  # inside tile 0's core of 12 m tiles
    engine = stream(build_model(model_config(tile_size=0.0), 2, 1), x[:300], y[:300])
    one = stream(build_model(model_config(tile_size=12.0), 2, 1), x[:300], y[:300])
    a, b = engine.recyclable_summary(), one.recyclable_summary()
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
    assert a["num_seen"] == b["num_seen"] == 300
    several = stream(build_model(model_config(), 2, 1), *samples(drive))
    with pytest.raises(MergeError, match="no single summary"):
        several.recyclable_summary()


def test_tiled_maps_of_two_robots_merge_tile_by_tile_as_well_as_one_map_of_all_their_data(drive):
    """Robot A maps the west half, robot B the east half, each with tiles; merged tile by tile (each merged tile
    the merge of the sources' tiles of one span, so a band's data are counted once per tile), the map of both is
    as good as one tiled map fed all the data and far better than either half. Measured when written: A 3.14, B
    2.23, all data 0.094, merged 0.076 uT."""
    from gp_mapping.gp.tiles import merge_tiled

    x, y = samples(drive)
    test_x, truth = held_out(drive)
    west = x[:, 0] < 4.0
    a = stream(build_model(model_config(), 2, 1), x[west], y[west])
    b = stream(build_model(model_config(), 2, 1), x[~west], y[~west])
    both = stream(build_model(model_config(), 2, 1), x, y)

    def rmse(model):
        return float(np.sqrt(np.mean((model.predict(test_x)[0][:, 0].numpy() - truth) ** 2)))

    merged, result = merge_tiled([("A", a.tile_summaries(), None), ("B", b.tile_summaries(), None)],
                                 model_config(), steps=30)
    assert isinstance(merged, TiledModel) and merged.layout == both.layout
    assert set(merged.tile_indices()) == set(a.tile_indices()) | set(b.tile_indices())
    assert result.tiles == merged.num_tiles and merged.num_seen == a.num_seen + b.num_seen == len(x)
    print(f"A {rmse(a):.3f} B {rmse(b):.3f} all data {rmse(both):.3f} merged {rmse(merged):.3f} uT")
    assert rmse(merged) <= 1.25 * rmse(both)
    assert rmse(merged) < 0.2 * min(rmse(a), rmse(b))
    # The merged map is a tiled map like any: it keeps mapping (tiles brought to the consensus first).
    before = merged.num_seen
    merged.update(x[:50], y[:50])
    assert merged.num_seen == before + 50 and rmse(merged) <= 1.25 * rmse(both)


def test_a_tiled_map_moved_onto_its_lattice_merges_to_itself_exactly_and_other_moves_are_refused(drive):
    """One source, no optimisation steps: the merged tiles are the source's (the ensemble bound is 0 there) in
    the moved frame, here a quarter turn and a shift by whole tiles, so the merged map at the moved points is
    the source's map to rounding. A move that does not carry tiles onto tiles (their spans, and so their data,
    would straddle tiles), other tile sizes and a mix with a map of one engine are refused by name."""
    from gp_mapping.gp.merging import MergeError, RigidTransform
    from gp_mapping.gp.tiles import merge_tiled

    source = stream(build_model(model_config(), 2, 1), *samples(drive))
    test_x, _ = held_out(drive)
    move = RigidTransform.planar(x=8.0, y=-4.0, yaw=np.pi / 2)
    moved, _ = merge_tiled([("A", source.tile_summaries(), move)], model_config(), steps=0)
    assert moved.num_tiles == source.num_tiles
    mean, var = source.predict(test_x)
    mean_m, var_m = moved.predict(move.apply_inputs(torch.as_tensor(test_x)))
    torch.testing.assert_close(mean_m, mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(var_m, var, rtol=1e-7, atol=1e-9)
    for bad in (RigidTransform.planar(x=1.0), RigidTransform.planar(yaw=np.pi / 6)):
        with pytest.raises(MergeError, match="carry its tiles onto tiles"):
            merge_tiled([("A", source.tile_summaries(), bad)], model_config(), steps=0)
    other = stream(build_model(model_config(tile_size=6.0), 2, 1), *samples(drive))
    with pytest.raises(MergeError, match="must share model.tile_size"):
        merge_tiled([("A", source.tile_summaries(), None), ("B", other.tile_summaries(), None)], model_config())
