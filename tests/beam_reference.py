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
    if source is None:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    else:
        config.decoder_start_token_id = prompt[0]
        out = model.generate(torch.tensor([source]), attention_mask=torch.ones(1, len(source), dtype=torch.long),
                             decoder_input_ids=torch.tensor([prompt]), generation_config=config)
    if params.num_beams == 1:    # greedy: score = summed log-probs of the raw logits / length ** penalty
        generated = out.sequences[0, len(prompt):].tolist()
        if any(t in eos for t in generated):
            generated = generated[:next(i for i, t in enumerate(generated) if t in eos) + 1]
        logprob = sum(float(torch.log_softmax(out.logits[i][0], -1)[t]) for i, t in enumerate(generated))
        return [(generated, logprob / len(generated) ** params.length_penalty)]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def assert_same(ours, expected):
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in expected]
    for (_, score), (_, reference) in zip(ours, expected):
        assert abs(score - reference) < 1e-4, (score, reference)
