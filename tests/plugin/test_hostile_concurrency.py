"""Hostile concurrent and interrupted runs: one writer per folder (a second refuses naming the first's pid), no
command replaces another's model without --overwrite, SIGTERM cleans up like Ctrl-C (exit 143), what a dead run
left is removed by the next one, and a full disk during a save leaves the old folder or a resumable run."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkmap_hf.locking import TEMPORARY_MARKER, lock_path, output_lock
from qkmap_hf.safety import folder_writer
from qkmap_hf.tasks import data_file
from tests.eval_utils import build_tokenizer, save_tiny_model
from tests.hostile import assert_refused, run_cli, tiny_llama, tree_digest

TRAIN_FLAGS = ("--block-size", "32", "--batch-size", "2", "--disable-tqdm", "--no-eval-on-start")
TRAIN_FLAGS += ("--eval-fraction", "0")  # no held-out evaluation: these runs test saving, not training
REPO_ROOT = Path(__file__).resolve().parents[2]

_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()} qkmap train\\n".encode())
print("locked", flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny QK-MAP checkpoint (with tokenizer), a tiny Llama source, and a text file."""
    root = tmp_path_factory.mktemp("hostile-concurrency")
    tokenizer = build_tokenizer(root / "tokenizer")
    save_tiny_model(root / "model", tokenizer, "qk_map", train_steps=0)
    tiny_llama(root / "llama")
    shutil.copy(data_file("haystack.txt"), root / "text.txt")
    return root


@pytest.fixture
def work(pristine, tmp_path):
    for name in ("model", "llama"):
        shutil.copytree(pristine / name, tmp_path / name)
    shutil.copy(pristine / "text.txt", tmp_path / "text.txt")
    (tmp_path / "outside.txt").write_text("a file beside the folders; never touched\n")
    return tmp_path


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _train(capsys, work, out, *extra):
    return run_cli(
        capsys,
        "train",
        "--model",
        work / "model",
        "--data",
        work / "text.txt",
        "--output-dir",
        out,
        *TRAIN_FLAGS,
        *extra,
    )


def _argv(command: str, work: Path) -> tuple[list[str], Path]:
    """``qkmap COMMAND ...`` writing (or publishing) ``work/target``, and that folder."""
    target = work / "target"
    data = str(work / "text.txt")
    return {
        "convert": (["convert", str(work / "llama"), str(target)], target),
        "train": (["train", "--model", str(work / "model"), "--data", data, "--output-dir", str(target)], target),
        "heal": (
            [
                "heal",
                str(work / "model"),
                "--teacher",
                str(work / "llama"),
                "--data",
                data,
                "--output-dir",
                str(target),
            ],
            target,
        ),
        "compare": (["compare", "--data", data, "--output-dir", str(target)], target),
        "card": (["card", str(work / "model")], work / "model"),
        "push": (["push", str(work / "model"), "org/name", "--dry-run"], work / "model"),
    }[command]


@pytest.mark.parametrize("command", ["convert", "train", "heal", "compare", "card", "push"])
def test_a_second_writer_refuses_naming_the_holder(command, work, capsys):
    argv, target = _argv(command, work)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(lock_path(target))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree_digest(work)
        code, out, err = run_cli(capsys, *argv)
        assert_refused(code, err, f"{target} is being written by another qkmap command (pid {holder.pid}")
        assert out == ""
        assert tree_digest(work) == before
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock: the next writer goes ahead (its stale lock file is no obstacle)
    if command == "card":
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        assert not lock_path(target).exists()


def test_a_second_open_file_in_the_same_process_is_refused_too(work):
    with output_lock(work / "out", "qkmap train") as held:
        assert held == lock_path(work / "out")
        assert held.read_text().split()[0] == str(os.getpid())
        with pytest.raises(ValueError, match=rf"pid {os.getpid()}"), output_lock(work / "out", "qkmap heal"):
            pass
    assert not lock_path(work / "out").exists()
    with output_lock(work / "out", "qkmap heal"):  # released: free again
        pass


def test_a_refused_command_leaves_no_folders_made_for_its_lock(work, capsys):
    before = tree_digest(work)
    code, _, err = run_cli(capsys, "convert", work / "missing-source", work / "new" / "nested" / "dst")
    assert code == 2, err
    assert not (work / "new").exists()
    assert tree_digest(work) == before
    code, _, err = run_cli(capsys, "convert", work / "llama", work / "new" / "nested" / "dst", "--no-progress")
    assert code == 0, err
    assert (work / "new" / "nested" / "dst" / "config.json").is_file()
    assert sorted(p.name for p in (work / "new" / "nested").iterdir()) == ["dst"]  # no lock file left


def _fake_heal_output(work: Path) -> Path:
    """A folder as `qkmap heal` leaves it: weights, training and healing records, card."""
    heal = work / "healed"
    shutil.copytree(work / "model", heal)
    (heal / "qkmap_training.json").write_text(json.dumps({"command": "qkmap train"}))
    (heal / "qkmap_healing.json").write_text(json.dumps({"kind": "healing", "command": "qkmap heal"}))
    (heal / "heal.json").write_text(json.dumps({"evaluations": []}))
    (heal / "README.md").write_text("---\nlicense: apache-2.0\n---\n# healed\n<!-- generated by qkmap card -->\n")
    return heal


def test_no_command_replaces_another_commands_model_without_overwrite(work, capsys):
    heal = _fake_heal_output(work)
    before = tree_digest(work)
    code, _, err = _train(capsys, work, heal, "--max-steps", "1")
    assert_refused(
        code,
        err,
        f"--output-dir {heal} holds the output of `qkmap heal` (qkmap_healing.json)",
        "`qkmap train` does not replace it without --overwrite",
    )
    assert tree_digest(work) == before

    trained = work / "trained"  # as `qkmap train` leaves it
    shutil.copytree(work / "model", trained)
    (trained / "qkmap_training.json").write_text(json.dumps({"command": "qkmap train"}))
    before = tree_digest(work)
    argv = ["heal", work / "model", "--teacher", work / "llama", "--data", work / "text.txt", "--output-dir", trained]
    code, _, err = run_cli(capsys, *argv)
    assert_refused(code, err, "holds the output of `qkmap train` (qkmap_training.json)")
    code, _, err = run_cli(capsys, "compare", "--data", work / "text.txt", "--output-dir", trained)
    assert_refused(code, err, "holds the output of `qkmap train`", "`qkmap compare` does not replace it")
    assert tree_digest(work) == before

    # with --overwrite the healed model is replaced, and its records and card go with it
    code, _, err = _train(capsys, work, heal, "--max-steps", "1", "--overwrite")
    assert code == 0, err
    assert folder_writer(heal) == ("qkmap train", "qkmap_training.json")
    assert not (heal / "qkmap_healing.json").exists() and not (heal / "README.md").exists()
    assert not (heal / "heal.json").exists()
    assert (heal / "model.safetensors").is_file()
    assert not list(work.glob(".healed.*"))
    # (the same command into its own folder needs no --overwrite: --resume below, in the full-disk test)


def test_dead_runs_temporaries_are_removed_by_the_next_run(work, capsys):
    dst = work / "converted"
    dead = _dead_pid()
    stale = work / f".converted.tmp-{dead}-abcd1234"
    stale.mkdir()
    (stale / TEMPORARY_MARKER).write_text(f"{dead}\n")  # what a dead run's own temporary carries
    (stale / "model.safetensors").write_bytes(b"half a shard")
    alive = work / f".converted.tmp-{os.getppid()}-live0000"  # a live process's: not touched
    alive.mkdir()
    (alive / TEMPORARY_MARKER).write_text(f"{os.getppid()}\n")
    (alive / "x").write_text("in use")
    # The user's own folders that merely look like temporaries: no pid, or no marker inside. Never touched.
    users = [work / ".converted.tmp-notes", work / f".converted.tmp-{dead}-mine"]
    for folder in users:
        folder.mkdir()
        (folder / "notes.txt").write_text("the user's")
    before = {path: digest for path, digest in tree_digest(work).items() if ".converted.tmp" not in path}
    kept = tree_digest(*users)
    code, out, err = run_cli(capsys, "convert", work / "llama", dst, "--no-progress")
    assert code == 0, err
    assert f"removed {stale}, a temporary folder left by pid {dead}, which did not finish" in err
    assert not stale.exists()
    assert (alive / "x").read_text() == "in use"
    assert tree_digest(*users) == kept and not any(str(folder) in err for folder in users)
    after = tree_digest(work)
    assert {path: after[path] for path in before} == before  # every other file as it was
    assert not lock_path(dst).exists()


def test_a_folder_moved_aside_by_a_dead_run_is_put_back(work, capsys):
    moved = work / f".converted.old-{_dead_pid()}-0000aaaa"
    code, _, err = run_cli(capsys, "convert", work / "llama", work / "first", "--no-progress")
    assert code == 0, err
    (work / "first").rename(moved)  # a run died between moving the old folder aside and moving the new one in
    (moved / TEMPORARY_MARKER).write_text("0\n")  # which marks the folder it moved aside
    weights = tree_digest(*moved.glob("*.safetensors"))
    code, _, err = run_cli(capsys, "card", work / "converted")
    assert code == 0, err
    assert f"restored {work / 'converted'} from {moved.name}, left by pid" in err
    assert not moved.exists()
    assert not (work / "converted" / TEMPORARY_MARKER).exists()
    assert tree_digest(*(work / "converted").glob("*.safetensors")) == {
        path.replace(str(moved), str(work / "converted")): digest for path, digest in weights.items()
    }


def test_sigterm_during_convert_is_handled_like_ctrl_c(work, capsys, monkeypatch):
    from qkmap_hf.conversion import api as writer

    original = writer.write_tensors

    def killed_mid_write(plan, source, out_dir, progress=True):
        (Path(out_dir) / "model.safetensors").write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this returns
        return original(plan, source, out_dir, progress)

    monkeypatch.setattr(writer, "write_tensors", killed_mid_write)
    handler = signal.getsignal(signal.SIGTERM)
    before = tree_digest(work)
    code, out, err = run_cli(capsys, "convert", work / "llama", work / "converted", "--no-progress")
    assert code == 143, err
    assert "qkmap convert: terminated (SIGTERM)" in err and "Traceback" not in err
    assert tree_digest(work) == before
    assert not (work / "converted").exists() and not list(work.glob(".converted*"))
    assert signal.getsignal(signal.SIGTERM) == handler  # main's handler is uninstalled again


@pytest.mark.slow
def test_full_disk_during_the_final_save_leaves_the_old_model(work, capsys, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    out = work / "out"
    code, _, err = _train(capsys, work, out, "--max-steps", "1")
    assert code == 0, err
    before = tree_digest(work)

    def disk_full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(modeling_utils, "safe_save_file", disk_full)
    code, _, err = _train(capsys, work, out, "--max-steps", "2", "--save-steps", "0")
    line = assert_refused(
        code,
        err,
        f"could not save the model {out}: {out / 'model.safetensors'}: No space left",
        "it needs about",
        "MB are free now",
        "The output folder was left as it was",
    )
    assert ".tmp-" not in line  # the hidden staging folder is not what the user is told about
    assert tree_digest(work) == before  # the old model, complete, and nothing else touched
    assert not list(work.glob(".out.*"))


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_names_the_folder_and_resume_continues(work, capsys, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    out = work / "out"
    original = modeling_utils.safe_save_file

    def full_at_checkpoint_2(tensors, filename, metadata=None):
        if "checkpoint-2" in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_at_checkpoint_2)
    flags = ("--max-steps", "2", "--save-steps", "1")
    code, _, err = _train(capsys, work, out, *flags)
    assert_refused(
        code,
        err,
        f"could not save the checkpoint {out / 'checkpoint-2'}",
        "No space left on device",
        "it needs about",
        "Run again with --resume",
    )
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()
    assert not (out / "model.safetensors").exists()  # no final model from a run that did not finish
    monkeypatch.setattr(modeling_utils, "safe_save_file", original)
    code, _, err = _train(capsys, work, out, *flags, "--resume")
    assert code == 0, err
    assert f"continuing from {out / 'checkpoint-1'}" in err and "checkpoint-2/trainer_state.json is missing" in err
    assert json.loads((out / "qkmap_training.json").read_text())["resumed_from"] == str(out / "checkpoint-1")
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_during_training_exits_143_and_leaves_no_temporaries(work):
    """A real `qkmap train` process receives SIGTERM mid-run (as from a scheduler or `timeout`)."""
    out = work / "out"
    argv = [
        sys.executable,
        "-m",
        "qkmap_hf",
        "train",
        "--model",
        str(work / "model"),
        "--data",
        str(work / "text.txt"),
        "--output-dir",
        str(out),
        *TRAIN_FLAGS,
        "--max-steps",
        "100000",
        "--save-steps",
        "1",
        "--save-total-limit",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("checkpoint-*/qkmap_checkpoint_complete.json")) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1]
            time.sleep(0.2)
        assert lock_path(out).read_text().split()[0] == str(process.pid)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 143, err
    assert "qkmap train: terminated (SIGTERM)" in err and "Traceback" not in err
    assert not lock_path(out).exists()
    assert not [p for p in work.iterdir() if p.name.startswith(".out.")]
    assert not (out / "model.safetensors").exists()


def test_a_full_disk_reported_by_safetensors_as_text_is_recognised(tmp_path):
    """safetensors' Rust writer reports ENOSPC as a SafetensorError whose text carries the OS error."""
    from safetensors import SafetensorError

    from qkmap_hf.training.guards import save_failed

    error = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    message = str(save_failed(tmp_path / "out" / "checkpoint-7", error, 2_500_000))
    assert message.startswith(f"could not save the checkpoint {tmp_path / 'out' / 'checkpoint-7'}: Error while")
    assert "it needs about 2.5 MB free on that disk" in message and "Run again with --resume" in message
    other = str(save_failed(tmp_path / "out", PermissionError(13, "Permission denied", str(tmp_path)), 1, "model"))
    assert "Permission denied" in other and "needs about" not in other and "left as it was" in other


@pytest.mark.parametrize("dangling", [False, True])
def test_a_lock_path_that_is_a_symlink_is_refused_and_its_target_untouched(work, dangling):
    from qkmap_hf.locking import FolderLockedError

    target = work / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    if not dangling:
        target.write_text("the user's file")
    folder = work / "out"
    lock_path(folder).symlink_to(target)
    with pytest.raises(FolderLockedError, match="is a symbolic link") as refused, output_lock(folder):
        pass
    assert "\n" not in str(refused.value)
    assert (target.read_text() == "the user's file") if not dangling else not target.exists()
    assert lock_path(folder).is_symlink()  # left for the user to look at
