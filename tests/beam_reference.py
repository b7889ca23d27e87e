"""transformers' generate as the reference for beam search: the hypotheses (generated tokens, score) it returns, on
the checkpoint's own model or (replayed_hypotheses) over the logits our engine computed (LogitsRecorder)."""

import numpy as np
import torch
import transformers

from metrale.runtime.beam.params import BeamParams

# The pad token generate fills finished rows with (never part of a hypothesis).
FILL = 0


def reference_hypotheses(model, prompt, params: BeamParams, eos, source=None,
                         use_cache: bool = True) -> list[tuple[list[int], float]]:
    """prompt: a decoder-only model's prompt, or with `source` an encoder-decoder's decoder_input_ids. use_cache
    False: each step's forward is given the whole sequences (replayed_hypotheses' model looks them up)."""
    config = transformers.GenerationConfig(
        num_beams=params.num_beams, max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
        length_penalty=params.length_penalty, early_stopping=params.early_stopping,
        no_repeat_ngram_size=params.no_repeat_ngram_size, num_return_sequences=params.num_return_sequences,
        do_sample=False, eos_token_id=list(eos), pad_token_id=FILL, return_dict_in_generate=True,
        output_scores=True, output_logits=True, use_cache=use_cache)
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


class LogitsRecorder:
    """While installed on an engine, records the logits row of every prefix its BeamGenerate calls compute one for
    in the host search (the forwards BeamCall runs: each prompt pass and each step; a device search's steps are not
    seen, so tests record with the device search off): rows[(request key, prefix tokens)] = float32 row, the
    request key the first block of the request's source's cross-attention K/V (encoder-decoders) or None
    (decoder-only models: their prompts must differ). Each sampled row's prefix is read from a shadow of the KV
    cache's slots (the token each forward wrote there, moved as the call's KV copies move them) through its block
    table."""

    def __init__(self, engine):
        self.engine, self.block_size = engine, engine.config.kv_block_size
        self.rows: dict[tuple, torch.Tensor] = {}
        self.sources: list[int] = []            # each request's key, in call order (the last call's)
        self._slots: dict[int, int] = {}
        self._batch = None

    def __enter__(self) -> "LogitsRecorder":
        engine, runner = self.engine, self.engine.runner
        forwards = engine.forwards
        encode, forward, copy_kv, candidates = (forwards.beam_encode, forwards.beam_forward, forwards.copy_blocks,
                                                runner.beam_candidates)

        def beam_encode(segments):
            self.sources = [int(segment.block_table.array()[0]) for segment in segments]
            return encode(segments)

        def beam_forward(batch, banned, count):
            for token, slot in zip(batch.token_ids.tolist(), batch.slot_mapping.tolist()):
                if slot >= 0:
                    self._slots[slot] = token
            self._batch = batch
            return forward(batch, banned, count)

        def copy(copies):
            for src, dst, n in copies:
                for i in range(n):
                    self._slots[dst * self.block_size + i] = self._slots[src * self.block_size + i]
            return copy_kv(copies)

        def beam_candidates(logits, banned, count):
            self._record(logits)
            return candidates(logits, banned, count)
        forwards.beam_encode, forwards.beam_forward, forwards.copy_blocks = beam_encode, beam_forward, copy
        runner.beam_candidates = beam_candidates
        return self

    def __exit__(self, *exc) -> None:
        forwards = self.engine.forwards
        del forwards.beam_encode, forwards.beam_forward, forwards.copy_blocks
        del self.engine.runner.beam_candidates

    def _record(self, logits) -> None:
        batch, size = self._batch, self.block_size
        if isinstance(logits, torch.Tensor):
            values = logits.float()
        else:       # the CUDA backend's bf16 rows
            bits = self.engine.runner.stream_context.copy_to_host(logits)
            values = torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32))
        segments = np.searchsorted(np.asarray(batch.query_starts), batch.sample_rows.numpy(), side="right") - 1
        for values_row, row, segment in zip(values, batch.sample_rows.tolist(), segments.tolist()):
            table, position = batch.block_tables[segment], int(batch.positions[row])
            prefix = tuple(self._slots[int(table[p // size]) * size + p % size] for p in range(position + 1))
            source = None if batch.cross is None else int(batch.cross.block_tables[segment][0])
            self.rows[(source, prefix)] = values_row.clone()


def round_logits_to_bf16(engine, monkeypatch) -> None:
    """The engine's forwards give their logits rounded to bf16, as the GPU's are (and LogitsRecorder records them
    so): equal logits are common then, and a search must rank them as the replay does (ties to the lower index)."""
    run_forward = engine.runner.run_forward
    monkeypatch.setattr(engine.runner, "run_forward", lambda forward, batch, replayable:
                        run_forward(forward, batch, replayable).to(torch.bfloat16).float())


def replayed_hypotheses(model, recorder: LogitsRecorder, request: int, prompt, params: BeamParams, eos,
                        source=None) -> list[tuple[list[int], float]]:
    """reference_hypotheses with the model's forward answering every step from the logits our engine computed for
    the same prefixes (recorder; request: its index in the recorded call): transformers' search over our logits.
    A prefix ours never computed means the two searches went different ways, and fails here. torch.topk breaks
    ties to the lower index meanwhile, as our kernels and search do (bf16 logits tie often; torch leaves the
    order of equal values open)."""
    key = recorder.sources[request] if source is not None else None

    def forward(*args, input_ids=None, decoder_input_ids=None, attention_mask=None, **kwargs):
        ids = (decoder_input_ids if decoder_input_ids is not None else input_ids).tolist()
        missing = [row for row in ids if (key, tuple(row)) not in recorder.rows]
        assert not missing, f"transformers' search reached {missing[0]}, which ours never ran"
        logits = torch.stack([recorder.rows[(key, tuple(row))] for row in ids])[:, None, :]
        return transformers.modeling_outputs.Seq2SeqLMOutput(logits=logits.to(model.device))
    model.forward, topk = forward, torch.topk
    torch.topk = _stable_topk
    try:
        return reference_hypotheses(model, prompt, params, eos, source=source, use_cache=False)
    finally:
        del model.forward
        torch.topk = topk


def _stable_topk(input, k, dim=-1, largest=True, sorted=True):
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def check_search(ours, model, recorder: LogitsRecorder, request: int, prompt, params: BeamParams, eos,
                 source=None) -> list[tuple[list[int], float]]:
    """ours against transformers' search over the logits ours computed (replayed_hypotheses on `model`): the same
    tokens, scores within float32 rounding of the steps' sums. Returns the replayed hypotheses."""
    replayed = replayed_hypotheses(model, recorder, request, prompt, params, eos, source)
    assert [t for t, _ in ours] == [t for t, _ in replayed]
    for (_, score), (_, theirs) in zip(ours, replayed):
        assert abs(score - theirs) <= 1e-4 * max(1.0, abs(theirs)), (score, theirs)
    return replayed
