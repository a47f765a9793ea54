"""``GET /cache_tree``: the top of the radix cache as JSON, and ``GET /cache_tree/prefix``:
the whole decoded prefix a node ends. See docs/dashboard.md for the fields.

The scheduler builds the snapshot (token ids, bounded by ``max_nodes``; ``CacheView``); this
process decodes the ids on the tokenizer threads and shapes the JSON, so the scheduler never
spends time on text.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from radix_cache.views import NodeView, unpack_views
from runtime.ipc import ControlCommand
from runtime.server.errors import ApiError
from runtime.server.state import ServerState, get_state

router = APIRouter()

DEFAULT_MAX_NODES = 200
# A snapshot costs the scheduler a few microseconds per node (docs/dashboard.md): the cap
# keeps one call well under the time of a decode step.
MAX_NODES_LIMIT = 500
CONTROL_TIMEOUT_S = 10.0


@router.get("/cache_tree")
async def cache_tree(
    request: Request,
    max_nodes: int = Query(
        DEFAULT_MAX_NODES,
        ge=1,
        le=MAX_NODES_LIMIT,
        description="Nodes to return at most (namespace roots included); the rest is folded.",
    ),
) -> Response:
    """The top of the radix cache by cached tokens: each node's token count, decoded text,
    hits, last access and state (locked by running requests, evictable), with what is not
    shown folded into counts; the nodes evicted lately; the last finished requests and
    the nodes holding their tokens; the cache's counters at the same moment."""
    state = get_state(request)
    raw = await scheduler_call(state, ControlCommand.CACHE_TREE, {"max_nodes": max_nodes})
    return JSONResponse(await render_cache_tree(state, raw, max_nodes))


@router.get("/cache_tree/prefix")
async def cache_tree_prefix(
    request: Request,
    node: int = Query(..., ge=1, description="A node id from the latest /cache_tree snapshot."),
) -> Response:
    """The whole prefix (root to the end of the node) a node of the latest snapshot ends,
    decoded: ``above_text`` (its ancestors' tokens) then ``node_text`` (its own); 404 if that
    snapshot did not show it or it has been evicted since."""
    state = get_state(request)
    reply = await scheduler_call(state, ControlCommand.NODE_PREFIX, {"node": node})
    if "missing" in reply:
        raise ApiError(404, reply["missing"], param="node")
    ids = reply["token_ids"].tolist()
    above = len(ids) - reply["node_tokens"]
    texts = await state.tokenizer_manager.run_tokenizer(
        lambda: _decode(state, [ids[:above], ids[above:]]), "node"
    )
    return JSONResponse(
        {
            "node": node,
            "tokens": len(ids),
            "node_tokens": reply["node_tokens"],
            "above_text": texts[0],
            "node_text": texts[1],
        }
    )


async def scheduler_call(
    state: ServerState, command: ControlCommand, args: dict[str, Any]
) -> dict[str, Any]:
    """A control command's reply; ApiError 503 if the scheduler does not answer in time, 500
    if it failed to."""
    state.require_ready()
    try:
        reply = await state.tokenizer_manager.control(command, CONTROL_TIMEOUT_S, args)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the scheduler did not answer {command!r} in time") from None
    if "error" in reply:
        raise ApiError(500, reply["error"])
    return reply


async def render_cache_tree(state: ServerState, raw: dict[str, Any], max_nodes: int) -> dict:
    """The JSON of a scheduler ``cache_tree`` reply: token runs decoded (on the tokenizer
    threads), requests named by their callers' rids."""
    if not raw["enabled"]:
        return {"enabled": False, "max_nodes": max_nodes, "nodes": [], "requests": []}
    views = unpack_views(raw["nodes"], raw["token_ids"])
    evicted = list(
        zip(
            raw["evicted_s_ago"],
            unpack_views(raw["evicted"], raw["evicted_token_ids"]),
            strict=True,
        )
    )
    shown = views + [view for _, view in evicted]
    runs = [view.head.tolist() for view in shown] + [view.tail.tolist() for view in shown]
    texts = await state.tokenizer_manager.run_tokenizer(lambda: _decode(state, runs), "text")
    heads, tails = texts[: len(shown)], texts[len(shown) :]
    nodes = [
        _node(view, heads[i], tails[i], _state(view), last_access_s=age)
        for i, (view, age) in enumerate(zip(views, raw["last_access_s"], strict=True))
    ]
    for node in nodes:  # each cache salt has its own root: label it (docs/serving.md)
        if node["parent"] is None:
            node["namespace"] = raw["namespaces"].get(node["id"])
    gone = [
        {**_node(view, heads[i], tails[i], "evicted", None), "evicted_s_ago": round(ago, 2)}
        for i, (ago, view) in enumerate(evicted, start=len(views))
    ]
    label = state.tokenizer_manager.label_of
    requests = [{"id": label(r["rid"]), **r} for r in raw["requests"]]
    for record in requests:
        record["latency_s"] = round(record["latency_s"], 4)
    return {
        "enabled": True,
        "max_nodes": max_nodes,
        "clock": raw["clock"],
        "stats": dataclasses.asdict(raw["stats"]),
        "shown_nodes": sum(view.parent_uid != 0 for view in views),
        "shown_tokens": sum(view.tokens for view in views),
        # Folded under the nodes shown, and in the namespaces (cache salts) whose roots were
        # not shown: with folded_namespaces, shown + folded is every cached token.
        "folded_tokens": sum(view.folded_tokens for view in views) + raw["folded_root_tokens"],
        "folded_namespaces": raw["folded_roots"],
        "scanned_nodes": raw["scanned"],
        "snapshot_ms": round(raw["snapshot_ms"], 3),
        "nodes": nodes,
        "recently_evicted": gone,
        "requests": requests,
    }


def _decode(state: ServerState, runs: list[list[int]]) -> list[str]:
    return list(
        state.tokenizer.batch_decode(
            runs, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    )


def _state(view: NodeView) -> str:
    if view.parent_uid == 0:
        return "root"
    return "locked" if view.lock_ref else "evictable"


def _node(
    view: NodeView, text: str, tail_text: str, state: str, last_access_s: float | None
) -> dict[str, Any]:
    return {
        "id": view.uid,
        "parent": view.parent_uid or None,
        "prefix_tokens": view.prefix_len,
        "tokens": view.tokens,
        "subtree_tokens": view.subtree_tokens,
        "text": text,
        "tail_text": tail_text,
        "elided_tokens": view.tokens - len(view.head) - len(view.tail),
        "hits": view.hit_count,
        "last_access_s": None if last_access_s is None else round(last_access_s, 2),
        "state": state,
        "locks": view.lock_ref,
        "children": view.children,
        "folded_children": view.folded_children,
        "folded_tokens": view.folded_tokens,
    }
