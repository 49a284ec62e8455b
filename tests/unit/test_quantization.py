"""Quantized weights and the fp8 KV cache in the engine (CPU): config and fingerprints, the layers swapped in at
load, the fp8 pool and its pages (mirrored, shipped as bytes), and accuracy on the real SmolLM2-135M.

The accuracy tests (`slow`) teacher-force a fixed English text of 2,384 tokens (written for this test, below)
through the unquantized model and each variant, via the engine's runner (the text in two chunks: the second reads
the first's K/V from the paged cache), and compare next-token argmax agreement and perplexity over its first
2,048 predictions. Thresholds are issue #18's. Measured on the 2-core CPU (torch 2.13), agreement / perplexity
increase: int8 weights (the CPU kernel, bf16 activations) 96.53% / +0.23%; fp8 weights with per-token activations
91.80% / +1.16%; fp8 KV (static scales 1.0) 95.17% / +1.30%. About 40 s for the three and the baseline.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from tandem.common.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.llm import LLM
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.quantization import QUANTIZED_PROJECTIONS, QuantizedLinear, weight_bytes
from tandem.engine.request import KVMirror, Request
from tandem.engine.runner import ModelRunner
from tandem.engine.weights import build_model, load_weights
from tandem.kernels import get_ops
from tandem.kernels.int8_linear import dequantize_int8_weight
from tandem.models import load_model_config, load_tokenizer
from tandem.serving.kv_transfer import messages_to_pages, pages_to_messages
from tests.factories import prompts_for, save_random_hf_model

FP8 = torch.float8_e4m3fn


def tiny_config(quantization: str | None = None, kv_cache_dtype: str = "auto", num_blocks: int | None = 64,
                **scheduler: int) -> EngineConfig:
    model = load_model_config("dummy:tiny", fetch=False)
    return EngineConfig(model=replace(model, quantization=quantization),
                        cache=CacheConfig(block_size=8, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
                        scheduler=SchedulerConfig(max_model_len=128, **scheduler))


def plain_model() -> LlamaForCausalLM:
    """The unquantized tiny model's seeded weights as plain tensors (a CPU runner keeps its fp32 linears' weights
    only oneDNN-packed)."""
    model = build_model(tiny_config().model, get_ops("torch"), torch.float32, torch.device("cpu"))
    load_weights(model, tiny_config().model)
    return model


# -- configuration ---------------------------------------------------------------------------------------------
def test_bad_values_are_refused_naming_the_field() -> None:
    model = load_model_config("dummy:tiny", fetch=False)
    with pytest.raises(ConfigError, match="quantization"):
        replace(model, quantization="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="dtype"):  # a KV dtype, not one to compute in
        EngineConfig(model=model, dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig.create(model, quantization="nf4")


def test_fingerprints_and_layouts_tell_the_variants_apart() -> None:
    model = load_model_config("dummy:tiny", fetch=False)
    configs = {(q, kv): EngineConfig.create(model, quantization=q, kv_cache_dtype=kv)
               for q in (None, "int8", "fp8") for kv in ("auto", "fp8")}
    # A worker with int8 weights computes other K/V than a bf16 one: never paired, whatever the KV dtype.
    assert len({c.model.fingerprint() for c in configs.values()}) == 3
    assert len({c.kv_layout.fingerprint() for c in configs.values()}) == 6
    assert EngineConfig.create(model).model == model  # quantization=None keeps the model's (none here)
    fp8_layout, fp32_layout = configs[None, "fp8"].kv_layout, configs[None, "auto"].kv_layout
    assert (fp8_layout.dtype, fp32_layout.dtype) == ("float8_e4m3fn", "float32")
    assert fp8_layout.block_bytes * 4 == fp32_layout.block_bytes
    # The fingerprint of an unquantized model is what it was before the field existed.
    assert model.fingerprint() == ModelConfig(**{f: getattr(model, f) for f in model.__dataclass_fields__
                                                 if f != "quantization"}).fingerprint()


# -- quantized layers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_load_swaps_the_projections_and_keeps_embeddings_and_head(method: str) -> None:
    packed = ModelRunner(tiny_config()).model  # on the CPU its fp32 linears hold oneDNN-packed weights only
    plain = plain_model()
    runner = ModelRunner(tiny_config(method))
    model = runner.model
    for layer, plain_layer in zip(model.model.layers, plain.model.layers, strict=True):
        for name in QUANTIZED_PROJECTIONS:
            linear, original = layer.get_submodule(name), plain_layer.get_submodule(name)
            assert isinstance(linear, QuantizedLinear) and isinstance(original, nn.Linear)
            assert linear.qweight.dtype == (torch.int8 if method == "int8" else FP8)
            assert linear.backend == ("cpu" if method == "int8" else "torch")
            # Per-output-channel codes of the same (seeded) weights, within the rounding bound of each format
            # (int8: half a step; e4m3: 2^-4 relative, 2^-10 of the scale below the normal range).
            error = (linear.quant_weight.dequantize() - original.weight).abs()
            scale = linear.scales[:, None]
            bound = scale / 2 if method == "int8" else original.weight.abs() * 2**-4 + scale * 2**-10
            assert (error <= bound * 1.0001).all()
            x = torch.randn(5, linear.in_features)
            relative_error = ((linear(x) - original(x)).norm() / original(x).norm()).item()
            assert relative_error < (0.01 if method == "int8" else 0.06)  # e4m3 keeps 3 mantissa bits, int8 ~7
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # No full-precision copy of a projection is left: only the embedding table, head and norms are float32.
    assert {n for n, p in model.named_parameters() if p.dtype == torch.float32} == {
        n for n, _ in plain.named_parameters() if not any(proj in n for proj in QUANTIZED_PROJECTIONS)}
    # Packed fp32 weights are held once; only the tied head (the embedding table's) is held twice, as the table and
    # as its packed copy.
    head_bytes = plain.lm_head.weight.numel() * plain.lm_head.weight.element_size()
    assert weight_bytes(model) < weight_bytes(packed) <= 1.05 * (weight_bytes(plain) + head_bytes)


def test_int8_codes_are_per_channel_absmax() -> None:
    runner = ModelRunner(tiny_config("int8"))
    plain = plain_model()
    linear = runner.model.model.layers[1].mlp.down_proj
    weight = plain.model.layers[1].mlp.down_proj.weight
    assert isinstance(linear, QuantizedLinear)
    assert linear.scales.shape == (weight.shape[0],)
    assert torch.allclose(linear.scales, weight.abs().amax(dim=1) / 127)
    assert (dequantize_int8_weight(linear.qweight, linear.scales) - weight).abs().max() <= linear.scales.max() / 2


# -- the fp8 KV cache ---------------------------------------------------------------------------------------------
def test_fp8_pool_holds_more_blocks_and_binds_its_scales() -> None:
    fp32 = ModelRunner(tiny_config(num_blocks=None))
    fp8 = ModelRunner(tiny_config(kv_cache_dtype="fp8", num_blocks=None))
    cache = fp8.kv_cache
    assert cache.tensor.dtype == FP8 and cache.layout == fp8.config.kv_layout
    assert cache.num_blocks == 4 * fp32.kv_cache.num_blocks  # same bytes, a quarter of fp32's per value
    assert cache.scales is not None and cache.scales.shape == (2, 2, 2)  # [layers, K|V, kv heads]
    assert torch.equal(cache.scales, torch.ones_like(cache.scales))
    for i, layer in enumerate(fp8.model.model.layers):
        attn = layer.self_attn
        assert attn.k_scale is not None and attn.v_scale is not None
        assert attn.k_scale.data_ptr() == cache.scales[i, 0].data_ptr()  # views: a calibration writes through
        assert attn.v_scale.data_ptr() == cache.scales[i, 1].data_ptr()
    assert fp32.kv_cache.scales is None and fp32.model.model.layers[0].self_attn.k_scale is None


def test_fp8_pages_are_written_as_bytes_and_float_pages_refused() -> None:
    cache = ModelRunner(tiny_config(kv_cache_dtype="fp8")).kv_cache
    k = (torch.randn(2, 8, 2, 16) * 3).to(FP8)
    v = (torch.randn(2, 8, 2, 16) / 3).to(FP8)
    cache.write_blocks(1, [5, 2], k, v)
    read_k, read_v = cache.read_blocks(1, [5, 2])
    assert read_k.dtype == FP8
    assert torch.equal(read_k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(read_v.view(torch.uint8), v.view(torch.uint8))
    with pytest.raises(ValueError, match="takes torch.float8_e4m3fn pages"):
        cache.write_blocks(1, [5, 2], k.float(), v.float())  # never re-cast through the model's dtype


def test_chunking_does_not_change_an_fp8_kv_result(tmp_path: Path) -> None:
    """Prompt chunks at position 0 attend to their K/V as the fp8 cache stores them, like every later chunk: the
    same tokens whatever the budget."""
    save_random_hf_model(tmp_path)
    prompts = prompts_for(512, [37, 5, 20])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for budget in (1024, 16, 7):
        llm = LLM(str(tmp_path), kv_cache_dtype="fp8", max_model_len=128, max_num_batched_tokens=budget)
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1] == outputs[2]


def test_mirrored_fp8_store_equals_the_local_pages() -> None:
    """Prefill role: the K/V stored into a peer fp8 pool (cuda-ipc's path) are the bytes of the local pages."""
    engine = Engine(tiny_config("int8", "fp8"))
    local = engine.runner.kv_cache.tensor
    peer = torch.full_like(local.view(torch.uint8), 0x7F).view(FP8)  # 0x7f: NaN in e4m3
    layers = [(peer[i, 0], peer[i, 1]) for i in range(peer.shape[0])]
    request = engine.add_request("m", prompts_for(512, [19])[0], SamplingParams(max_tokens=1, seed=0),
                                 prefill_only=True, kv_mirror=KVMirror(layers, [7, 30, 11]))
    engine.step()
    for layer in range(peer.shape[0]):
        k, v = engine.read_pages(request, layer)
        index = torch.tensor([7, 30, 11])
        for mirrored, pages in ((peer[layer, 0], k), (peer[layer, 1], v)):
            got = mirrored.view(torch.uint8)[index].flatten(0, 1)[:19]
            assert torch.equal(got, pages.view(torch.uint8).flatten(0, 1)[:19])


def test_fp8_pages_shipped_as_bytes_give_the_colocated_tokens() -> None:
    """Disaggregated, int8 weights and fp8 pages: prefill here, pages as the grpc transport's raw bytes (one byte
    per value), decode there; the tokens are a single engine's."""
    config = tiny_config("int8", "fp8")
    prompt = prompts_for(512, [21])[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, seed=3)
    colocated = Engine(config)
    expected = colocated.add_request("c", prompt, params)
    while colocated.has_unfinished():
        colocated.step()

    prefill, decode = Engine(config), Engine(config)
    layout = decode.layout
    assert prefill.layout == layout and layout.dtype == "float8_e4m3fn"
    sent = prefill.add_request("r", prompt, params, prefill_only=True)
    first = prefill.step()
    assert first.requests == [sent] and len(sent.output_token_ids) == 1
    received = decode.add_request("r", prompt, params, remote_prefill=True)
    assert decode.step().reserved == [received]
    for layer in range(layout.num_layers):
        k, v = prefill.read_pages(sent, layer)
        for message in pages_to_messages(layer, k, v):
            assert len(message.k) == message.num_blocks * layout.block_bytes_per_layer
            assert layout.block_bytes_per_layer == layout.block_size * layout.num_kv_heads * layout.head_dim
            decode.write_pages("r", layer, message.block_start, *messages_to_pages(message, layout))
    decode.activate("r", sent.output_token_ids[0], sent.output_logprobs[0])
    while decode.has_unfinished():
        decode.step()
    assert received.output_token_ids == expected.output_token_ids


# -- accuracy on the real SmolLM2-135M ----------------------------------------------------------------------------
# Written for this test (not from any corpus): plain expository English on several topics.
TEXT = """\
The lighthouse on the northern cape was built in the spring of 1871, after three ships were lost on the same reef \
in a single winter. The engineers who designed it had never seen the place. They worked from charts, letters and a \
wooden model that a local carpenter sent to the capital on a mail coach. When the first stones were finally set in \
place, the keeper who would live there for the next thirty years was still a boy working in his father's boatyard, \
learning to bend planks with steam and to judge the weather by the colour of the evening sky.

His name was Thomas Ward, and he kept a journal from the first night he climbed the tower. Most of the entries are \
short. He wrote down the direction of the wind, the state of the sea, the number of ships he saw, and how much oil \
the lamp had burned. Every few pages, however, he allowed himself a longer note. He described a storm that tore the \
door off the storehouse, a seal that slept for three days on the landing steps, and a winter so cold that the spray \
froze on the windows of the lantern room and had to be scraped away every hour. Reading the journal today, one is \
struck less by the drama of these events than by the patience of the man who recorded them. He did the same work \
every night, in the same order, and he seems to have found a quiet satisfaction in doing it well.

A lighthouse is a simple machine with a demanding purpose. It must be seen from far away, it must be recognised, and \
it must never fail. The first requirement is met by height and by the lens. A tower of sixty metres on a cliff can \
be seen from more than twenty nautical miles on a clear night, because the curve of the earth hides lower lights \
much sooner. The lens gathers the light from a small flame or lamp and bends it into a narrow, intense beam. The \
second requirement is met by the pattern of the light. Each lighthouse along a coast has its own signature: a single \
flash every ten seconds, two quick flashes followed by a long darkness, or a steady light that is briefly eclipsed. \
Sailors carry a list of these signatures, so that a light seen at night tells them not only that land is near but \
exactly which piece of land it is. The third requirement, that the light never fails, was for most of the \
nineteenth century met by people like Thomas Ward.

Bread is another old technology that rewards patience. At its simplest, it needs only flour, water, salt and time. \
When flour and water are mixed, two proteins in the wheat join together to form gluten, a network of long, elastic \
strands. Yeast, whether it comes from a packet or from a sourdough starter kept alive in a jar, feeds on the sugars \
in the flour and releases carbon dioxide. The gas is trapped in the gluten network, and the dough rises. Kneading \
strengthens the network, but so does time: a wet dough left overnight in a cool kitchen will develop much of the \
same structure without any work at all. This is why many bakers now prefer long, slow fermentation. The bread takes \
longer to make, but it has a deeper flavour, a more open crumb and a crust that stays crisp for longer.

The oven matters as much as the dough. In the first minutes of baking, the water in the dough turns to steam and \
the gas bubbles expand quickly, so the loaf grows in size. Bakers call this the oven spring. If the crust hardens \
too early, the loaf cannot expand, and it may crack in the wrong places. For this reason professional ovens inject \
steam at the start of the bake, and home bakers often use a heavy pot with a lid, which traps the moisture released \
by the dough itself. After twenty minutes the lid is removed, the surface dries, and the crust begins to brown. The \
browning is the result of a set of chemical reactions between sugars and proteins that produce hundreds of \
different flavour compounds. It is the same process that gives colour and taste to roasted coffee, toasted nuts and \
grilled meat.

Maps, like bread and lighthouses, are tools that hide a great deal of work behind a simple surface. A modern road \
map looks obvious, but every line on it is the result of decisions about what to include and what to leave out. \
The earth is round, and a sheet of paper is flat, so every map distorts something. Some projections preserve the \
shapes of small areas but make countries near the poles look much larger than they are. Others preserve area but \
stretch shapes, so that continents appear tall and thin. Sailors long preferred projections in which a line of \
constant compass bearing is drawn as a straight line, because this made it easy to plan a course, even though it \
made Greenland look as large as Africa. There is no perfect choice, only a choice that suits a particular purpose.

The history of mapmaking is also a history of measurement. Before satellites, surveyors measured the land with \
chains, wooden rods and instruments that recorded angles. They began with a carefully measured baseline, often \
several kilometres long, laid out across flat ground. From the two ends of this line they measured the angles to a \
distant church tower or hilltop. With one known side and two known angles, the other sides of the triangle could \
be calculated. Each new triangle became the base for the next, and a chain of triangles slowly crossed entire \
countries. The work took decades. Surveyors carried heavy instruments up mountains, waited days for clear weather, \
and checked their calculations by hand, because a single error early in the chain would spread into every \
measurement that followed.

Today a small receiver in a telephone can find its position to within a few metres by listening to signals from \
satellites. Each satellite carries a very precise clock and continuously broadcasts the time and its own position. \
The receiver compares the time in each signal with the time at which it arrived. Because the signals travel at the \
speed of light, a difference of a millionth of a second corresponds to about three hundred metres. With signals \
from four or more satellites, the receiver can solve for its position in three dimensions and for the error of its \
own, much cheaper clock. The system depends on an extraordinary level of accuracy. The clocks on the satellites \
must even be corrected for the effects of relativity, since time passes at a slightly different rate in orbit than \
it does on the ground.

Bridges offer a different lesson in engineering. A bridge must carry its own weight, the weight of the traffic that \
crosses it, and the forces of wind, water and temperature. Engineers describe these loads in terms of two basic \
forces: compression, which pushes material together, and tension, which pulls it apart. Stone and concrete are \
strong in compression but weak in tension, which is why the oldest large bridges are arches. In an arch, the weight \
of the bridge and its load is turned into compression that flows along the curve and down into the foundations. \
Steel is strong in tension as well as compression, and it made possible the long suspension bridges of the modern \
era, in which the deck hangs from cables that are draped over tall towers and anchored firmly in the ground at each \
end.

Temperature is a quiet but constant enemy of large structures. Steel expands as it warms, and a bridge deck a \
kilometre long can grow by more than half a metre between a cold winter night and a hot summer afternoon. If the \
deck were fixed rigidly at both ends, the forces produced by this expansion would be enormous. Engineers therefore \
build in expansion joints, which look like metal teeth set across the road, and bearings that allow the deck to \
slide slightly on its supports. Drivers rarely notice these details, but without them the bridge would tear itself \
apart within a few seasons. Good engineering is often invisible in this way. It is noticed only when it is missing.

Gardens teach patience of a slower kind. A gardener who plants an apple tree may wait four or five years for the \
first good harvest, and the tree may go on bearing fruit for half a century. Most apple trees are grafted: a branch \
from a variety with good fruit is joined to the roots of another tree chosen for its strength or its size. The \
seeds of an apple do not grow true to their parent. A tree grown from the seed of a sweet, red apple may produce \
small, sour, green fruit, because each seed carries a new mixture of genes from two parents. For this reason every \
tree of a famous variety is, in a sense, a piece of the same original tree, copied again and again by grafting over \
hundreds of years.

Soil is more alive than it looks. A single handful of healthy garden soil contains billions of bacteria, kilometres \
of fungal threads, and countless small animals, from worms and beetles to creatures too small to see. Together they \
break down dead leaves and roots, release nutrients that plants can absorb, and build the crumbly structure that \
lets water and air move through the ground. Gardeners who add compost are not only feeding their plants; they are \
feeding this whole hidden community. Heavy digging can damage it, which is why some gardeners now prefer to disturb \
the soil as little as possible, adding organic matter to the surface each year and letting the worms carry it down.

Music, finally, is a craft in which patience and precision meet. A violin maker may spend two months building a \
single instrument. The top is usually carved from spruce, a light and stiff wood, and the back from maple, which is \
harder and more dense. The maker shapes each plate by hand, tapping it and listening to the sound it makes, and \
removes wood a little at a time until the plate rings at the right pitch. The varnish, applied in many thin coats, \
protects the wood and affects the tone. Once the instrument is finished, it changes slowly over the years as it is \
played. Many musicians believe that an instrument which has been played every day for decades sounds richer than \
one that has been kept in a case, although this is difficult to prove.

Learning to play an instrument follows the same pattern as the other crafts described here. Progress comes from \
small, repeated efforts rather than from sudden leaps. A student practises scales, not because scales are \
beautiful, but because they train the hands to move without conscious thought. After months of practice, difficult \
passages that once seemed impossible become comfortable, and the player's attention is free to turn from the \
mechanics of the notes to the shape of the music. Teachers often say that slow practice is the fastest way to \
improve. Playing a passage slowly and correctly builds a habit that holds up at full speed, while playing it \
quickly and carelessly builds a habit of mistakes.

There is a common thread in all of these stories. The keeper in his tower, the baker waiting for the dough, the \
surveyor on the mountain, the engineer planning for a hot afternoon, the gardener with a young tree and the student \
with a violin are all engaged in work whose results arrive slowly. Each of them depends on knowledge passed down by \
others, and each adds something small to it. The lighthouse on the northern cape was automated in 1968, and the \
lamp is now controlled by a computer that sends a message to the coast guard if anything goes wrong. Thomas Ward's \
journal is kept in a museum in the nearest town, open at a page from the winter of 1889, where he wrote, in a \
careful and steady hand, that the night had been long and cold, that the light had burned without interruption, \
and that in the morning the sea had been calm.
"""
NUM_PREDICTIONS = 2048
CHUNK = 1024  # two chunks: the second attends over the first's pages (paged prefill), as a long prompt does


def teacher_forced(runner: ModelRunner, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax [N] and negative log-likelihood [N] of each next token of `token_ids` (N = len - 1), through the
    engine's chunked prefill; the hidden states of every position are taken from the model's forward."""
    request = Request(req_id="text", prompt_token_ids=token_ids, params=SamplingParams(max_tokens=1), seed=0)
    request.block_ids = list(range(-(-len(token_ids) // runner.block_size)))
    targets = torch.tensor(token_ids[1:])
    hidden: list[torch.Tensor] = []
    hook = runner.model.register_forward_hook(lambda module, args, out: hidden.append(out))
    argmax, nll = [], []
    try:
        with torch.inference_mode():
            for start in range(0, len(token_ids) - 1, CHUNK):
                num = min(CHUNK, len(token_ids) - 1 - start)
                runner.chunk_logits([(request, start, num)], [1])
                logits = runner.model.compute_logits(hidden.pop())  # [num, V]
                argmax.append(logits.argmax(-1))
                nll.append(-logits.log_softmax(-1).gather(1, targets[start:start + num, None])[:, 0])
    finally:
        hook.remove()
    return torch.cat(argmax), torch.cat(nll)


def smollm2_runner(path: Path, num_tokens: int, quantization: str | None = None,
                   kv_cache_dtype: str = "auto") -> ModelRunner:
    config = EngineConfig.create(load_model_config(str(path)), max_model_len=num_tokens + 16,
                                 num_kv_blocks=-(-(num_tokens + 16) // 16), quantization=quantization,
                                 kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(config)


@pytest.fixture(scope="module")
def text_ids(smollm2_path: Path) -> list[int]:
    token_ids = load_tokenizer(load_model_config(str(smollm2_path))).encode(TEXT)
    assert len(token_ids) >= 2000
    return token_ids[:NUM_PREDICTIONS + 1]


@pytest.fixture(scope="module")
def unquantized(smollm2_path: Path, text_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return teacher_forced(smollm2_runner(smollm2_path, len(text_ids)), text_ids)


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "kv_cache_dtype", "min_agreement", "max_ppl_increase"), [
    ("int8", "auto", 0.96, 0.01),
    ("fp8", "auto", 0.88, 0.06),
    (None, "fp8", 0.93, 0.02),
], ids=["int8-weights", "fp8-weights", "fp8-kv"])
def test_smollm2_accuracy(smollm2_path: Path, text_ids: list[int], unquantized: tuple[torch.Tensor, torch.Tensor],
                          quantization: str | None, kv_cache_dtype: str, min_agreement: float,
                          max_ppl_increase: float) -> None:
    runner = smollm2_runner(smollm2_path, len(text_ids), quantization, kv_cache_dtype)
    argmax, nll = teacher_forced(runner, text_ids)
    base_argmax, base_nll = unquantized
    agreement = (argmax == base_argmax).float().mean().item()
    ppl_increase = math.exp(nll.mean().item() - base_nll.mean().item()) - 1
    print(f"{quantization} weights, {kv_cache_dtype} KV: agreement {agreement:.2%}, perplexity "
          f"{math.exp(nll.mean().item()):.3f} vs {math.exp(base_nll.mean().item()):.3f} ({ppl_increase:+.2%})")
    assert agreement >= min_agreement
    assert ppl_increase <= max_ppl_increase
