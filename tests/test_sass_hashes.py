"""experiments/sass-hashes.txt pins the SASS of the builds experiments/sass_hashes.py lists, as the tree that last
changed a kernel on purpose left it: a restructuring of the kernels' source (masks, aggregates, host halves) must
leave them byte-identical. A few of them are compiled here (all of them: ``python3 experiments/sass_hashes.py OUT``);
a change meant to alter the kernels writes the file again and says so."""
import pytest

from .experiment_scripts import load_experiment

PINNED = ("hopper fp16 D=128 causal=True {}",
          "hopper bf16 D=128 causal=False {'block_m': 128, 'box_causal': (False, True, False), "
          "'boxes': ((2, 8, 8), (2, 8, 8))}",
          "hopper_bwd bf16 D=128 causal=False {'window': 9, 'boxes': ((2, 4, 8), (2, 8, 8))}",
          "blackwell fp16 D=128 causal=False {'window': 8, 'boxes': ((4, 8, 8), (2, 8, 8))}")


def _pinned() -> dict:
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "experiments" / "sass-hashes.txt").read_text()
    return dict(line.split("\t") for line in text.splitlines() if line)


def test_the_pinned_file_lists_every_build_once_with_a_hash():
    script = load_experiment("sass_hashes")
    pinned = _pinned()
    assert sorted(pinned) == sorted(script.label(i) for i in range(len(script.BUILDS)))
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in pinned.values())
    assert len(set(pinned.values())) == len(pinned)  # (every build its own binary)


@pytest.mark.compile
@pytest.mark.parametrize("label", PINNED)
def test_builds_compile_to_the_pinned_sass(label):
    script = load_experiment("sass_hashes")
    i = [script.label(n) for n in range(len(script.BUILDS))].index(label)
    assert script.sass_hash(i) == _pinned()[label]
