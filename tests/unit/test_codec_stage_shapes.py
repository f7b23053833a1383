"""The codec stage's shapes (models/codec_stage.py): windows decode padded to a frame bucket in a
padded batch (behind a full lookahead, or in front of a full left context), and keep exactly the
audio each gives decoded alone at its own length; a window with neither is not padded; the warm-up
covers the buckets."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_speechlm.models.codec_stage import SpeechLMCodecDecoder, batch_bucket, frame_bucket


@pytest.mark.parametrize("n, bucket", [(1, 1), (3, 4), (16, 16), (17, 32), (33, 48), (256, 256)])
def test_batch_buckets(n, bucket):
    assert batch_bucket(n) == bucket


@pytest.fixture(scope="module", params=["bagpiper", "opuslm"])
def stage(request, tmp_path_factory):
    from vllm_omni_speechlm.make_tiny import make_tiny

    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny(request.param, out, seed=0)
    return SpeechLMCodecDecoder.from_model_dir(str(out))


def _alone(stage, codes: torch.Tensor, left: int, holdback: int) -> torch.Tensor:
    """A window decoded by itself at its own length, its new frames kept."""
    wav = stage.codec.decode(codes.T[None])[0].float()
    return stage._trim(wav, codes.shape[0], left, holdback, stage.hop)


def test_padded_windows_keep_what_each_gives_alone(stage):
    g = torch.Generator().manual_seed(0)
    q, size, reach = stage.num_quantizers, stage.codec.config.codebook_size, stage.right_reach
    left_reach = stage.left_reach
    # (left, new, holdback): ramp windows with a lookahead (padded behind to 16 / 32 frames); a
    # short lookahead and a clip's end behind a full left context (padded in front); neither (as is)
    shapes = [(0, 2, reach), (2, 2, reach), (4, 4, reach), (8, 8, reach), (left_reach, 3, 2), (left_reach + 4, 5, 0),
              (3, 5, 0), (2, 3, 2)]
    windows = [torch.randint(0, size, (left + new + hold, q), generator=g) for left, new, hold in shapes]
    infos = [{"meta": {"left_context_size": left, "right_holdback_size": hold}} for left, _, hold in shapes]
    atol = 1e-3 if stage.cfg.codec.type == "dac" else 1e-4  # float rounding of other shapes (streaming tests' bounds)
    with torch.inference_mode():
        got = stage.decode_windows([w.reshape(-1) for w in windows], infos)
        for w, (left, new, hold), audio in zip(windows, shapes, got):
            bucketed, _ = stage._bucketed(w, left, hold)
            assert (bucketed.shape[0] == frame_bucket(w.shape[0]) > w.shape[0]) == (hold >= reach or left >= left_reach)
            torch.testing.assert_close(audio, _alone(stage, w, left, hold), atol=atol, rtol=0)
            assert audio.numel() <= new * stage.hop


def test_warm_up_decodes_every_bucket(stage):
    with torch.inference_mode():
        assert stage.warm_up(max_batch=20, max_frames=40, max_ids=10**6) == len([1, 2, 4, 8, 16, 32]) * len([16, 32, 48])
        # a step's code budget caps the batch of longer windows: 20 of 16 frames, 10 of 32, 6 of 48
        # (bucketed up to 32, 16, 8)
        q = stage.num_quantizers
        assert stage.warm_up(max_batch=20, max_frames=40, max_ids=20 * 16 * q) == 6 + 5 + 4


def test_the_first_dummy_forward_warms_the_buckets_once(tmp_path):
    """vLLM's profile run calls forward with no runtime information: the stage decodes its buckets
    then (the deploy's window settings and step budget), once; a forward with windows does not."""
    from types import SimpleNamespace

    from vllm_omni_speechlm.make_tiny import make_tiny

    make_tiny("bagpiper", tmp_path, seed=0)
    extra = {"codec_chunk_frames": 10, "codec_left_context_frames": 10, "codec_right_holdback_frames": 10}
    config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(tmp_path), async_chunk=True, stage_connector_config={"extra": extra}),
        device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=4096),
    )
    stage = SpeechLMCodecDecoder(vllm_config=config)
    warmed, warm_up = [], stage.warm_up
    stage.warm_up = lambda *shapes: warmed.append((shapes, warm_up(*shapes))) or warmed[-1][1]
    q = stage.num_quantizers
    with torch.inference_mode():
        stage.forward(input_ids=torch.zeros(3 * q, dtype=torch.long))  # the dummy run
        stage.forward(input_ids=torch.zeros(3 * q, dtype=torch.long))
        window = {"meta": {"left_context_size": 0, "right_holdback_size": 10}}
        out = stage.forward(input_ids=torch.zeros(12 * q, dtype=torch.long), runtime_additional_information=[window])
    # windows of up to 10 + 10 + 10 = 30 frames: buckets 16 and 32, batches 1, 2, 4
    assert warmed == [((4, 30, 4096, ()), 6)]
    assert out.multimodal_outputs["model_outputs"][0].numel() == 2 * stage.hop
    # a ramp from a short first lookahead: its first window (2 frames, the 8 a lookahead of 2
    # frees, and those 2) is decoded at its own 12 frames, warmed too
    extra |= {"initial_codec_chunk_frames": 2, "codec_ramp_min_speed_percent": 125, "codec_ramp_min_right_holdback_frames": 2}
    assert SpeechLMCodecDecoder(vllm_config=config)._warm_shapes == (4, 30, 4096, (12,))
    with torch.inference_mode():
        assert stage.warm_up(4, 30, 4096, (12,)) == 6 + 3


def test_a_step_padded_past_its_windows_decodes_the_windows(stage):
    """vLLM pads a step's input ids to a CUDA-graph capture size (a 37-frame window, 296 ids, ran
    as 304); the padding is no window's."""
    g = torch.Generator().manual_seed(1)
    q, size = stage.num_quantizers, stage.codec.config.codebook_size
    windows = [torch.randint(0, size, (frames, q), generator=g) for frames in (37, 5)]
    infos = [{"meta": {"left_context_size": 10, "right_holdback_size": 10}}, {"meta": {"left_context_size": 2, "right_holdback_size": 0}}]
    ids = torch.cat([w.reshape(-1) for w in windows] + [torch.zeros(q, dtype=torch.long)])
    with torch.inference_mode():
        out = stage.forward(input_ids=ids, runtime_additional_information=infos, seq_token_counts=[37 * q, 5 * q])
        want = stage.decode_windows([w.reshape(-1) for w in windows], infos)
    for got, expected in zip(out.multimodal_outputs["model_outputs"], want):
        torch.testing.assert_close(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("family", ["bagpiper", "opuslm"])  # X-Codec, DAC
def test_decode_graphs_give_the_eager_decode_and_unrecorded_shapes_run_eagerly(tmp_path, family):
    from vllm_omni_speechlm.make_tiny import make_tiny

    make_tiny(family, tmp_path, seed=0)
    eager = SpeechLMCodecDecoder.from_model_dir(str(tmp_path), "cuda")
    graphed = SpeechLMCodecDecoder.from_model_dir(str(tmp_path), "cuda", graphs=True)
    with torch.inference_mode():
        graphed.warm_up(4, 30, 4096)
        q = eager.num_quantizers
        for frames, holdback in ((30, 10), (12, 0)):  # a bucketed window; a clip's end at its own length
            codes = [torch.randint(0, eager.codec.config.codebook_size, (frames * q,), device="cuda") for _ in range(3)]
            infos = [{"meta": {"left_context_size": 0, "right_holdback_size": holdback}}] * 3
            for a, b in zip(eager.decode_windows(codes, infos), graphed.decode_windows(codes, infos)):
                torch.testing.assert_close(a, b)
    assert len(graphed._graphs) == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a Triton kernel")
@pytest.mark.parametrize("family", ["bagpiper", "opuslm"])  # X-Codec, DAC
def test_fused_snakes_give_the_eager_samples_on_graphs_too(tmp_path, family):
    """The one-kernel Snake runs the eager expression's operations in the same order: the same
    samples, bit for bit, eagerly and replayed from the decode graphs."""
    from vllm_omni_speechlm.make_tiny import make_tiny

    make_tiny(family, tmp_path, seed=0)
    eager = SpeechLMCodecDecoder.from_model_dir(str(tmp_path), "cuda")
    fused = SpeechLMCodecDecoder.from_model_dir(str(tmp_path), "cuda", fused=True)
    graphed = SpeechLMCodecDecoder.from_model_dir(str(tmp_path), "cuda", graphs=True, fused=True)
    q, size = eager.num_quantizers, eager.codec.config.codebook_size
    with torch.inference_mode():
        graphed.warm_up(4, 30, 4096)
        for batch, frames in ((1, 12), (3, 30), (4, 45)):  # graphed, graphed, a shape without a graph
            codes = [torch.randint(0, size, (frames * q,), device="cuda") for _ in range(batch)]
            infos = [{"meta": {"left_context_size": 0, "right_holdback_size": 10}}] * batch
            want = eager.decode_windows(codes, infos)
            for other in (fused, graphed):
                for a, b in zip(want, other.decode_windows(codes, infos)):
                    torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_fused_snakes_need_cuda(tmp_path):
    from vllm_omni_speechlm.make_tiny import make_tiny

    make_tiny("bagpiper", tmp_path, seed=0)
    with pytest.raises(ValueError, match="fused Snakes need a decoder on CUDA, not cpu"):
        SpeechLMCodecDecoder.from_model_dir(str(tmp_path), fused=True)


@pytest.mark.parametrize("key", ["speech_lm_codec_graphs", "speech_lm_codec_fused_snake"])
@pytest.mark.parametrize("switch, warns", [
    (True, True),  # asked for: said aloud
    (None, False),  # the default: on where the stage runs on CUDA, silently off elsewhere
    (False, False),
])
def test_cuda_switches_off_cuda_decode_eagerly(tmp_path, key, switch, warns):
    """`additional_config: {speech_lm_codec_graphs / _fused_snake: ...}` on a CPU stage: the plain
    eager decode, with a warning only when the speed-up was asked for."""
    stage, seen = _cpu_codec_stage(tmp_path, {} if switch is None else {key: switch})
    assert stage._graphs is None and all(m.inv_alpha is None for m in stage.codec.modules() if hasattr(m, "inv_alpha"))
    assert seen == ([f"codec stage: {key} needs CUDA; decoding eagerly on cpu"] if warns else [])


@pytest.mark.parametrize("key", ["speech_lm_codec_graphs", "speech_lm_codec_fused_snake"])
def test_a_cuda_switch_that_is_not_a_bool_is_refused(tmp_path, key):
    with pytest.raises(ValueError, match=f"additional_config.{key}: expected true or false"):
        _cpu_codec_stage(tmp_path, {key: "yes"})


def _cpu_codec_stage(model_dir, additional_config: dict) -> tuple[SpeechLMCodecDecoder, list[str]]:
    """The stage model as vLLM builds it on CPU, and the messages it logged."""
    import logging
    from types import SimpleNamespace

    from vllm_omni_speechlm.make_tiny import make_tiny
    from vllm_omni_speechlm.models import codec_stage

    make_tiny("bagpiper", model_dir, seed=0)
    config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(model_dir), async_chunk=False), device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=4096),
        additional_config=additional_config,
    )
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    codec_stage.logger.addHandler(handler)
    try:
        return SpeechLMCodecDecoder(vllm_config=config), seen
    finally:
        codec_stage.logger.removeHandler(handler)
