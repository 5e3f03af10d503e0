"""POST /classify, /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank), as vLLM serves
them, on a --runner pooling engine.

/classify runs a classifier (--convert classify) on each input. /score and /rerank score text
pairs with jaxllm/entrypoints/score_utils.py (a cross-encoder's relevance, or an embedding
model's cosine similarity), the same `ScoreJob` as the offline `LLM.score`: the pairs are
tokenized on the tokenizer thread, and each prompt pooled on the engine thread. A model that
cannot serve a route answers vLLM's 400 ("The model does not support ... API").
"""

from __future__ import annotations

from typing import Optional

from jaxllm.entrypoints.score_utils import ScoreJob, score_pairs, score_tasks_error
from jaxllm.pooling_params import PoolingParams
from serving.errors import APIError
from serving.protocol import UsageInfo
from serving.protocol_score import (ClassificationData, ClassificationRequest,
                                    ClassificationResponse, RerankDocument, RerankRequest,
                                    RerankResponse, RerankResult, RerankUsage, ScoreRequest,
                                    ScoreResponse, ScoreResponseData, ScoringBody)
from serving.serving_embedding import _pool
from serving.state import ServingState, check_text_length


def _tasks(state: ServingState) -> tuple[str, ...]:
    return state.engine.supported_tasks


def _num_labels(state: ServingState) -> Optional[int]:
    head = state.engine.classifier
    return None if head is None else head.num_labels


def _check(req: ScoringBody) -> None:
    ServingState.warn_ignored_fields(req)
    if req.truncate_prompt_tokens is not None:
        raise APIError("truncate_prompt_tokens is not supported by this server",
                       param="truncate_prompt_tokens")


async def create_classify(state: ServingState, req: ClassificationRequest,
                          base_id: str) -> ClassificationResponse:
    if "classify" not in _tasks(state):
        raise APIError("The model does not support Classification API")
    _check(req)
    params = PoolingParams(use_activation=req.use_activation, task="classify")
    name, outs, tokens = await _pool(state, req, base_id, params)
    head = state.engine.classifier
    data = [ClassificationData(index=i, label=head.label(o.outputs.data),
                               probs=o.outputs.data.tolist(), num_classes=head.num_labels)
            for i, o in enumerate(outs)]
    return ClassificationResponse(id=f"classify-{base_id}", model=name, data=data,
                                  usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


async def _score(state: ServingState, req: ScoringBody, base_id: str, data_1, data_2,
                 fields: tuple[str, str]) -> tuple[str, list[tuple[float, list[int]]]]:
    """(model name, (score, prompt tokens) per pair) for text(s) `data_1` against `data_2`;
    `fields` name them in errors (text_1/text_2, or query/documents)."""
    _check(req)
    name = state.model_name(req.model, adapters=False)
    try:
        pairs = score_pairs(data_1, data_2)
    except ValueError as e:
        raise APIError(str(e), param=fields[0] if str(e).startswith("text_1") else fields[1])
    for i, field in enumerate(fields):
        for text in {pair[i] for pair in pairs}:
            try:
                check_text_length(state.limits, text, state.max_model_len)
            except APIError as e:
                e.param = field  # the text's own field, not a prompt's
                raise
    if len(pairs) > state.limits.max_n_sequences:
        raise APIError(f"{len(pairs)} pairs is more than the {state.limits.max_n_sequences} "
                       f"this server allows per request (--max-n-sequences).", param=fields[1])
    tok = state.require_tokenizer()
    job = await state.in_tokenizer_thread(ScoreJob.build, _tasks(state), tok, pairs,
                                          req.use_activation, _num_labels(state))
    ticket = state.admission.enter(len(job.prompts))
    try:
        outs = []
        for i, (ids, params) in enumerate(zip(job.prompts, job.prompt_params)):
            try:
                outs.append(await state.engine.encode({"prompt_token_ids": ids}, params,
                                                      f"{base_id}-{i}"))
            except ValueError as e:
                raise APIError(str(e), param=fields[1]) from None
    finally:
        ticket.release()
    return name, job.scores(outs)


async def create_score(state: ServingState, req: ScoreRequest, base_id: str) -> ScoreResponse:
    if score_tasks_error(_tasks(state), _num_labels(state)) is not None:
        raise APIError("The model does not support Score API")
    name, scores = await _score(state, req, base_id, req.text_1, req.text_2,
                                ("text_1", "text_2"))
    tokens = sum(len(ids) for _, ids in scores)
    return ScoreResponse(id=f"score-{base_id}", model=name,
                         data=[ScoreResponseData(index=i, score=s)
                               for i, (s, _) in enumerate(scores)],
                         usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


async def create_rerank(state: ServingState, req: RerankRequest,
                        base_id: str) -> RerankResponse:
    if score_tasks_error(_tasks(state), _num_labels(state)) is not None:
        raise APIError("The model does not support Rerank (Score) API")
    if req.top_n < 0:
        raise APIError("top_n must be at least 0 (0: all documents)", param="top_n")
    if not req.documents:
        raise APIError("documents: at least one document must be given", param="documents")
    name, scores = await _score(state, req, base_id, req.query, req.documents,
                                ("query", "documents"))
    results = sorted((RerankResult(index=i, document=RerankDocument(text=doc),
                                   relevance_score=s)
                      for i, (doc, (s, _)) in enumerate(zip(req.documents, scores))),
                     key=lambda r: r.relevance_score, reverse=True)
    top_n = req.top_n if 0 < req.top_n < len(results) else len(results)
    tokens = sum(len(ids) for _, ids in scores)
    return RerankResponse(id=f"rerank-{base_id}", model=name, results=results[:top_n],
                          usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))
