"""transformers' generate as the reference for beam search: the hypotheses (generated tokens, score) it returns."""

import torch
import transformers

from metrale.runtime.beam.params import BeamParams

# The pad token generate fills finished rows with (never part of a hypothesis).
FILL = 0


def reference_hypotheses(model, prompt, params: BeamParams, eos, source=None) -> list[tuple[list[int], float]]:
    """prompt: a decoder-only model's prompt, or with `source` an encoder-decoder's decoder_input_ids."""
    config = transformers.GenerationConfig(
        num_beams=params.num_beams, max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
        length_penalty=params.length_penalty, early_stopping=params.early_stopping,
        no_repeat_ngram_size=params.no_repeat_ngram_size, num_return_sequences=params.num_return_sequences,
        do_sample=False, eos_token_id=list(eos), pad_token_id=FILL, return_dict_in_generate=True,
        output_scores=True, output_logits=True)
    device = model.device
    if source is None:
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             generation_config=config)
    else:
        config.decoder_start_token_id = prompt[0]
        out = model.generate(torch.tensor([source], device=device),
                             attention_mask=torch.ones(1, len(source), dtype=torch.long, device=device),
                             decoder_input_ids=torch.tensor([prompt], device=device), generation_config=config)
    if params.num_beams == 1:    # greedy: score = summed log-probs of the raw logits / length ** penalty
        generated = out.sequences[0, len(prompt):].tolist()
        if any(t in eos for t in generated):
            generated = generated[:next(i for i, t in enumerate(generated) if t in eos) + 1]
        logprob = sum(float(torch.log_softmax(out.logits[i][0].float(), -1)[t]) for i, t in enumerate(generated))
        return [(generated, logprob / len(generated) ** params.length_penalty)]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def assert_same(ours, expected):
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in expected]
    for (_, score), (_, reference) in zip(ours, expected):
        assert abs(score - reference) < 1e-4, (score, reference)


def load_references(directory, device: str, encoder_decoder: bool = False) -> tuple:
    """transformers on the checkpoint as a backend's hypotheses are checked against (check_hypotheses): float32 on
    the CPU for the CPU backend; float32 and bfloat16 on the GPU for the CUDA backend (bf16)."""
    load = (transformers.M2M100ForConditionalGeneration if encoder_decoder
            else transformers.AutoModelForCausalLM).from_pretrained
    if device == "cpu":
        return (load(directory, dtype=torch.float32).eval(),)
    return tuple(load(directory, dtype=dtype).cuda().eval() for dtype in (torch.float32, torch.bfloat16))


def check_hypotheses(ours, references: tuple, prompt, params: BeamParams, eos, source=None) -> bool:
    """ours against transformers' generate. One float32 reference (the CPU backend): the same hypotheses, scores
    within 1e-4. A float32 and a bfloat16 reference (the CUDA backend): where transformers' own bf16 run gives
    its float32 tokens, the same tokens, and scores within 1e-2 (relative, absolute below 1) or within 1.5x
    transformers' own bf16 score error, whichever is larger; a request whose bf16 tokens differ is decided by bf16
    rounding and is not compared. Returns whether it was compared."""
    expected = reference_hypotheses(references[0], prompt, params, eos, source=source)
    if len(references) == 1:
        assert_same(ours, expected)
        return True
    theirs_bf16 = reference_hypotheses(references[1], prompt, params, eos, source=source)
    if [t for t, _ in theirs_bf16] != [t for t, _ in expected]:
        return False
    assert [t for t, _ in ours] == [t for t, _ in expected]
    for (_, score), (_, want), (_, theirs) in zip(ours, expected, theirs_bf16):
        assert abs(score - want) <= max(1e-2 * max(1.0, abs(want)), 1.5 * abs(theirs - want)), (score, want, theirs)
    return True
