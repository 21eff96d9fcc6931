"""Our Qwen2-VL and Qwen2.5-VL vision towers against transformers' own (`model.model.visual`),
with the weights read from the checkpoint transformers saves, on the image processor's real
pixel values: float32 outputs equal to 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.models.qwen2_vl_vision import (
    Qwen2VisionTower,
    Qwen25VisionTower,
    patch_rows_cols,
    window_layout,
)
from tests.support.qwen2_vl_models import (
    KINDS,
    build_qwen_vl,
    hf_model_class,
    image_processor,
    random_image,
)

TOWERS = {"qwen2_vl": Qwen2VisionTower, "qwen2_5_vl": Qwen25VisionTower}


@pytest.fixture(scope="module", params=KINDS)
def kind_and_folder(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    return kind, build_qwen_vl(tmp_path_factory.mktemp(kind), kind, seed=3)


def _visual_tensors(folder: Path) -> list[tuple[str, torch.Tensor]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith("visual.")]  # noqa: SIM118
        assert names, "transformers saved no `visual.` tensors"
        return [(n.removeprefix("visual."), f.get_tensor(n)) for n in names]


def _towers(kind: str, folder: Path):
    reference = hf_model_class(kind).from_pretrained(folder, dtype=torch.float32).eval()
    ours = TOWERS[kind](reference.config.vision_config)
    ours.load_weights(_visual_tensors(folder))
    return ours.eval(), reference.model.visual


# (width, height) each: a 6x8-patch grid (Qwen2.5-VL: two whole and two cut windows), a
# 4x4 one (one window), a 2x6 one (one row of merge blocks)
SIZES = [(112, 84), (56, 56), (84, 28)]


@pytest.mark.parametrize("sizes", [[SIZES[0]], [SIZES[1]], SIZES], ids=["6x8", "4x4", "three"])
def test_tower_equals_transformers(kind_and_folder, sizes) -> None:
    kind, folder = kind_and_folder
    ours, reference = _towers(kind, folder)
    images = [random_image(seed, size) for seed, size in enumerate(sizes)]
    inputs = image_processor()(images=images, return_tensors="pt")
    pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
    with torch.no_grad():
        expected = reference(pixels, grid_thw=grids).pooler_output
        got = ours(pixels, grids)
    assert got.shape == (ours.num_tokens(grids), 64)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Each image attends only to itself: the first image alone gives its own rows unchanged.
    with torch.no_grad():
        first = int(grids[0].prod())
        alone = ours(pixels[:first], grids[:1])
    torch.testing.assert_close(alone, got[: alone.shape[0]], atol=1e-5, rtol=1e-5)


def test_patch_positions_follow_merge_blocks() -> None:
    """Patches come block by block: a 2x4 grid with 2x2 blocks is (0,0) (0,1) (1,0) (1,1),
    then the next block's columns 2 and 3."""
    got = patch_rows_cols(torch.tensor([[1, 2, 4]]), 2).tolist()
    assert got == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


def test_windows_tile_from_the_top_left() -> None:
    """3x4 merge blocks in windows of 2x2: blocks [0 1 4 5], [2 3 6 7], [8 9], [10 11]."""
    layout = window_layout(torch.tensor([[1, 6, 8]]), merge_size=2, window_blocks=2)
    assert layout.block_order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11]
    assert layout.cu_seqlens == [0, 16, 32, 40, 48]


def test_missing_tower_tensor_is_refused(kind_and_folder) -> None:
    kind, folder = kind_and_folder
    from transformers import AutoConfig

    tower = TOWERS[kind](AutoConfig.from_pretrained(folder).vision_config)
    tensors = [(n, t) for n, t in _visual_tensors(folder) if not n.startswith("merger.mlp.2")]
    with pytest.raises(ModelLoadError, match="missing"):
        tower.load_weights(tensors)
