"""labkit calibrate: the role gate between calibration and validation rows, the fit (recovers known parameters
from rows a known profile priced; is moved by calibration rows and never by validation rows), fitted profiles
found by name, and the CLI."""

from __future__ import annotations

import copy
import csv
import json
import math
import random

import pytest

from labkit.cli import main
from labkit.theory import calibrate as cal
from labkit.theory.cluster import get_cluster

TRUTH = {"peak_tflops": 0.04, "memory_gbps": 12.0, "kernel_overhead_s": 6e-6, "gemm_k_half": 24.0,
         "link_gbps": 1.5, "hop_latency_s": 4e-5, "base_latency_s": 1.5e-4}
SHAPES = [(s, s, s) for s in (16, 32, 64, 128, 256, 512, 1024)] + [(1, 1024, 1024), (8, 1024, 1024),
                                                                     (512, 512, 8), (512, 512, 32),
                                                                     (1024, 64, 1024), (128, 2048, 128)]


def synthetic_rows(truth=TRUTH, noise=0.03, seed=0, world_size=2) -> list[dict]:
    """A recording of a machine that *is* the profile ``truth`` (priced by the emulator's own functions), with
    multiplicative noise: what labkit record would write on it."""
    rng = random.Random(seed)
    cl = cal.build_cluster("truth", world_size, truth)
    rows = []
    for m, n, k in SHAPES:
        rows.append({"kind": "gemm", "op": "mm", "shape": f"{m}x{n}x{k}", "dtype": "fp32",
                     "bytes": (m * k + k * n + m * n) * 4, "flops": 2 * m * n * k})
    for n in (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22):
        rows.append({"kind": "memory", "op": "add", "shape": str(n), "dtype": "fp32", "bytes": 12 * n, "flops": n})
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"):
        for s in (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22):
            rows.append({"kind": "collective", "op": op, "shape": "", "dtype": "fp32", "bytes": s, "flops": 0})
    for r in rows:
        r["world_size"] = world_size
        r["seconds"] = cal.price_row(cl, r) * math.exp(rng.gauss(0, noise))
        r["label"] = "measured (synthetic)"
    rows.append({"kind": "step", "op": "dp", "shape": "dp2 tp1 pp1", "seconds": 0.3, "world_size": world_size})
    return rows


# -- the role gate ---------------------------------------------------------------------------------------------
def test_split_roles_keeps_order_and_names_a_bad_row():
    rows = [{"role": "calibration", "op": "a"}, {"role": " Validation ", "op": "b"}, {"role": "calibration"}]
    c, v = cal.split_roles(rows)
    assert [r.get("op") for r in c] == ["a", None] and [r["op"] for r in v] == ["b"]
    for bad in ({"source": "nccl-tests#212", "op": "all_reduce"}, {"role": "train", "source": "x"}, {"role": ""}):
        with pytest.raises(ValueError, match=r"row 1 .*role=.*must be one of \('calibration', 'validation'\)"):
            cal.split_roles([{"role": "calibration"}, bad])
    with pytest.raises(ValueError, match="row 0 is list"):
        cal.split_roles([[1, 2]])
    assert cal.calibration_rows(rows) == c and cal.validation_rows(rows) == v


def test_assign_roles_alternates_sizes_deterministically_and_never_fits_steps():
    rows = synthetic_rows()
    a = cal.assign_roles(rows)
    b = cal.assign_roles(list(reversed(rows)))
    key = lambda r: (r["kind"], r["op"], r["shape"], r["bytes"] if "bytes" in r else "")  # noqa: E731
    assert sorted((key(r), r["role"]) for r in a) == sorted((key(r), r["role"]) for r in b)  # order-independent
    assert all(r["role"] == "validation" for r in a if r["kind"] == "step")
    ar = sorted((r for r in a if r["op"] == "all_reduce"), key=lambda r: r["bytes"])
    assert [r["role"] for r in ar] == ["calibration", "validation"] * 3 + ["calibration"]
    kept = cal.assign_roles([{"kind": "gemm", "op": "mm", "bytes": 1, "role": "validation"}])
    assert kept[0]["role"] == "validation"
    with pytest.raises(ValueError, match="role='held-out'"):
        cal.assign_roles([{"kind": "gemm", "role": "held-out"}])


# -- the fit ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted():
    rows = synthetic_rows()
    return rows, cal.calibrate_rows(rows, name="synthetic", identity={"device": "synthetic"})


def test_fit_recovers_the_parameters_that_priced_the_rows(fitted):
    _, prof = fitted
    p = {k: v["value"] for k, v in prof["parameters"].items()}
    for name in ("peak_tflops", "memory_gbps", "link_gbps"):
        assert p[name] == pytest.approx(TRUTH[name], rel=0.1), name
    assert p["kernel_overhead_s"] == pytest.approx(TRUTH["kernel_overhead_s"], rel=0.3)
    assert prof["summary"]["calibration"]["median_abs_error"] < 0.05
    assert prof["summary"]["validation"]["median_abs_error"] < 0.06  # rows the fit never saw
    assert prof["parameters"]["peak_tflops"]["source"].startswith("fit on ")
    assert prof["label"].startswith("fit (") and prof["format"] == cal.FORMAT
    assert prof["per_op"]["all_reduce"]["busbw_gbps"] == pytest.approx(TRUTH["link_gbps"], rel=0.25)
    n_valid = sum(1 for r in cal.assign_roles(cal.measured_rows(fitted[0])) if r["role"] == "validation"
                  and r["kind"] != "step")
    assert len(prof["residuals"]["validation"]) == n_valid > 10


def test_validation_rows_never_influence_the_fit(fitted):
    rows, prof = fitted
    roles = cal.assign_roles(cal.measured_rows(rows))
    perturbed = copy.deepcopy(roles)
    for r in perturbed:
        if r["role"] == "validation" and r["kind"] != "step":
            r["seconds"] *= 10.0  # a validation row 10x off
    again = cal.calibrate_rows(perturbed, name="synthetic", identity={"device": "synthetic"})
    assert {k: v["value"] for k, v in again["parameters"].items()} == \
        {k: v["value"] for k, v in prof["parameters"].items()}
    assert again["summary"]["validation"]["median_abs_error"] > 0.85  # ... and validation shows it (fit = 0.1 x)


def test_a_calibration_row_does_move_the_fit(fitted):
    """The companion of the test above: the same perturbation on calibration rows changes the parameters (so an
    unchanged fit above means the validation rows were not read, not that nothing can move it)."""
    rows, prof = fitted
    roles = cal.assign_roles(cal.measured_rows(rows))
    for r in roles:
        if r["role"] == "calibration" and r["kind"] == "gemm":
            r["seconds"] *= 10.0
    again = cal.calibrate_rows(roles, name="synthetic")
    assert again["parameters"]["peak_tflops"]["value"] < 0.3 * prof["parameters"]["peak_tflops"]["value"]


def test_a_wrong_compute_speed_fails_the_recording_it_was_fitted_on(fitted):
    """Mutation: the fitted profile with compute 10x too fast prices the calibration GEMMs far off."""
    _, prof = fitted
    from labkit.theory.cluster import Cluster

    good = Cluster.from_dict(prof["cluster"])
    bad = cal.scaled_compute(good, 10.0)
    rows = [r for r in cal.assign_roles(cal.measured_rows(synthetic_rows(seed=3))) if r["kind"] == "gemm"]
    assert cal.summarize(cal.residuals(good, rows))["median_abs_error"] < 0.1
    assert cal.summarize(cal.residuals(bad, rows))["median_abs_error"] > 0.5
    with pytest.raises(ValueError, match="factor"):
        cal.scaled_compute(good, float("nan"))


def test_fit_needs_compute_rows():
    rows = [r for r in synthetic_rows() if r["kind"] == "collective"]
    with pytest.raises(ValueError, match="needs calibration rows of kind 'gemm' and 'memory'"):
        cal.calibrate_rows(rows, name="x")
    with pytest.raises(ValueError, match="no calibration rows"):
        cal.fit(lambda u: None, ["a"], [1.0], [])


def test_trace_rows_are_priced_as_the_sum_of_their_operations():
    cl = cal.build_cluster("t", 2, TRUTH)
    ops = [[2 * 64 ** 3, 3 * 64 * 64 * 4, "fp32", 3], [0, 4096, "fp32", 10]]
    want = 3 * cl.compute_s(2 * 64 ** 3, 3 * 64 * 64 * 4) + 10 * cl.compute_s(0, 4096)
    assert cal.price_row(cl, {"kind": "trace", "trace": ops}) == pytest.approx(want)
    with pytest.raises(ValueError, match="no traced operations"):
        cal.price_row(cl, {"kind": "trace", "shape": "m"})
    with pytest.raises(ValueError, match="cannot be priced"):
        cal.price_row(cl, {"kind": "step"})


# -- profiles on disk, by name ---------------------------------------------------------------------------------
def test_saved_profile_is_found_by_name(fitted, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILES", str(tmp_path))
    _, prof = fitted
    prof = dict(prof, name="synthetic-machine")
    path = cal.save_profile(prof, tmp_path / "synthetic-machine.json")
    assert cal.load_profile("synthetic-machine")["name"] == "synthetic-machine" and path.is_file()
    cl = get_cluster("synthetic-machine")
    assert cl.device.peak_tflops["fp32"] == pytest.approx(prof["parameters"]["peak_tflops"]["value"])
    assert get_cluster("synthetic-machine", link_efficiency=0.5).link_efficiency == 0.5
    with pytest.raises(ValueError, match="synthetic-machine"):  # the error lists the fitted names
        get_cluster("no-such-profile")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a fitted profile"):
        cal.load_profile("broken")


# -- the command -------------------------------------------------------------------------------------------------
def _write_recording(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    cols = sorted({k for r in rows for k in r})
    with open(folder / "recording.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    (folder / "identity.json").write_text(json.dumps({"device": "synthetic", "machine": "synthetic"}))


def test_cli_calibrate_writes_the_profile_and_reports_both_residuals(tmp_path, capsys):
    _write_recording(tmp_path / "rec", synthetic_rows())
    out = tmp_path / "p.json"
    assert main(["calibrate", str(tmp_path / "rec"), "--name", "cli-machine", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "peak_tflops" in text and "calibration" in text and "validation" in text
    prof = json.loads(out.read_text())
    assert prof["name"] == "cli-machine" and prof["residuals"]["validation"]
    assert main(["calibrate", str(tmp_path / "rec"), "--name", "cli-machine", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "cli-machine"


@pytest.mark.parametrize("args, needle", [
    (["calibrate", "/nonexistent-dir", "--name", "x"], "holds no recording.csv"),
    (["calibrate", ".", "--name", "../evil"], "--name='../evil'"),
])
def test_cli_calibrate_bad_input_is_one_line_exit_2(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
