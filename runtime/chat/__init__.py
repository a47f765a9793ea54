"""The turn pipeline: one chat turn from a typed request to typed events, below the HTTP APIs.

Each API (chat completions, Responses, Messages) is an adapter into a ``TurnSpec`` and a
renderer of the ``TurnReader``'s events; the Engine and ``/generate`` read reasoning with the
same reader. Nothing here imports ``runtime.server`` (docs/architecture.md, "The turn
pipeline").
"""
