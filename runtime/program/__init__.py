"""Compiled DSL programs: a straight-line segment of a ``frontend_lang`` program (text, gen,
select, role text, fork/join) executed next to the KV cache as one unit.

``spec`` parses a program request (``POST /program``, ``Engine.run_program``); ``executor``
runs it on the tokenizer manager's loop, each step continuing the previous step's KV in place
(pinned in the scheduler, ``runtime/scheduler/program_pins.py``); ``select_math`` is the choice
scoring the DSL's interpreter and the executor share. See docs/dsl.md, "Compiled execution".
"""
