"""Structured output in one place: the grammar-backend contract (`backend`), the
grammars a request asks for (`request_specs`), the built-in backends (xgrammar,
llguidance; registered by `builtin`), and the scheduler's side: grammars compiled
off its thread (`grammar_compiler`) and the requests waiting for them
(`grammar_queue`)."""
