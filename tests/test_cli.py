"""common.cli: ``parse`` (``--config`` in either form, a bad config file or a YAML value that is not text named) and
``run``'s exit: the objects alive at the end are frozen out of the garbage collector (the interpreter's last
collections cost over a second a process), except when a nanobind extension is loaded, whose exit check reports what
the freeze keeps as leaks (triton 3.9, which torch._dynamo imports: dozens of lines after every job)."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_process_without_nanobind_freezes_its_objects_at_exit():
    proc = python(
        "import gc\nfrom common.cli import freeze_for_exit\nprint(freeze_for_exit(), gc.get_freeze_count() > 0)"
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stderr


def test_a_loaded_nanobind_class_is_found_and_nothing_is_frozen(monkeypatch):
    import gc

    from common import cli

    meta = type("nb_meta", (type,), {"__module__": "nanobind"})  # what nanobind's classes are instances of
    module = types.ModuleType("fake_nanobind_extension")
    module.Context = meta("Context", (), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    frozen = gc.get_freeze_count()
    assert cli.nanobind_extension_loaded() and cli.freeze_for_exit() is False
    assert gc.get_freeze_count() == frozen


def test_an_entry_point_with_triton_loaded_exits_without_leak_reports():
    pytest.importorskip("triton")
    proc = python("import triton\nfrom common.cli import run\nrun(lambda: print('done'))")
    assert proc.returncode == 0 and proc.stdout.strip() == "done"
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_a_bad_input_error_says_where_it_was_raised_and_the_whole_traceback_on_request(capsys, monkeypatch):
    """Every ValueError became one line and exit 2, a defect's deep in a job too: nothing to debug from."""
    import numpy as np

    from common import cli

    def job():
        return np.zeros(3) + np.zeros(4)  # not bad input: a shape error in a job

    monkeypatch.setattr(cli, "freeze_for_exit", lambda: None)  # this process goes on: nothing frozen out of the gc
    for traceback_on in (False, True):
        if traceback_on:
            monkeypatch.setenv("REFINE_RL_TRACEBACK", "1")
        else:
            monkeypatch.delenv("REFINE_RL_TRACEBACK", raising=False)
        with pytest.raises(SystemExit) as done:
            cli.run(job)
        said = capsys.readouterr().err
        assert done.value.code == 2 and said.startswith("error: operands could not be broadcast together")
        assert ("Traceback (most recent call last)" in said) == traceback_on
        assert (f"raised at {__file__}:" in said and ", in job;" in said) != traceback_on


def test_a_yaml_list_of_numbers_reaches_trl_as_numbers(tmp_path):
    """YAML reads 5e-1 (no dot) as text; argparse converts only what the command line gives."""
    from trl import GRPOConfig

    from common.cli import parse

    config = tmp_path / "c.yaml"
    cpu = "output_dir: out\nuse_cpu: true\nbf16: false\nactivation_checkpointing: false\n"
    config.write_text(cpu + "reward_weights: [1.0, 5e-1]\n")
    (args,) = parse((GRPOConfig,), ["--config", str(config)])
    assert args.reward_weights == [1.0, 0.5]
    config.write_text(cpu + "reward_weights: [1.0, half]\n")
    with pytest.raises(ValueError, match=r"--reward_weights: \[1.0, 'half'\] holds an item that is not a number"):
        parse((GRPOConfig,), ["--config", str(config)])


def test_config_with_an_equals_sign_is_read_as_with_a_space(tmp_path):
    from common.cli import parse
    from gate.train.build_data import BuildDataArgs

    (tmp_path / "c.yaml").write_text("stage: label\nverbalisers: ['Yes', 'No']\n")
    (spaced,) = parse((BuildDataArgs,), ["--config", str(tmp_path / "c.yaml")])
    (joined,) = parse((BuildDataArgs,), [f"--config={tmp_path / 'c.yaml'}"])
    assert spaced == joined and joined.stage == "label" and joined.verbalisers == ["Yes", "No"]


@pytest.mark.parametrize(
    "yaml_text,argv_tail,match",
    [
        ("stage: label\nverbalisers: [yes, no]\n", [], r"--verbalisers: True is not text \(YAML reads it as bool\)"),
        ("stage: label\nverbalisers: Rel NoRel\n", [], r"--verbalisers: 'Rel NoRel' is not a list"),
        ("stage: label\nout: 1.5\n", [], r"--out: 1\.5 is not text \(YAML reads it as float\): quote it"),
        ("stage: [label\n", [], r"--config .*c\.yaml: not valid YAML"),
        ("stage: label\n", ["--config"], r"--config needs a YAML file after it"),
        ("stage: label\n", ["--config", "--out", "x"], r"--config needs a YAML file after it"),
        ("stage: label\n", ["--config="], r"--config needs a YAML file after it"),
        ("stage: label\n", ["--config", "."], r"--config \.: no such file"),  # a folder
        ("- a\n- list\n", [], r"c\.yaml: a YAML mapping of settings is needed, got a list"),
    ],
)
def test_a_bad_config_is_a_value_error_naming_it(tmp_path, yaml_text, argv_tail, match):
    """run() turns a ValueError into one line; these were tracebacks (IndexError, yaml's ParserError) or, for YAML's
    booleans in a text setting, a TypeError far from the config (verbalisers ``yes`` / ``no``)."""
    from common.cli import parse
    from gate.train.build_data import BuildDataArgs

    (tmp_path / "c.yaml").write_text(yaml_text)
    argv = [] if argv_tail else ["--config", str(tmp_path / "c.yaml")]
    with pytest.raises(ValueError, match=match):
        parse((BuildDataArgs,), argv + argv_tail)


def test_the_grpo_entry_points_early_read_of_a_broken_config_is_named(tmp_path):
    """rl.train_grpo reads --config for its world before the parse: malformed YAML was a yaml traceback there."""
    import rl.train_grpo as tg

    (tmp_path / "bad.yaml").write_text("stage: [label\n")
    with pytest.raises(ValueError, match=r"--config .*bad\.yaml: not valid YAML"):
        tg.parse_arguments(["--config", str(tmp_path / "bad.yaml")])
