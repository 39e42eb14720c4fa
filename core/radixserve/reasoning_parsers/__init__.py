"""Reasoning parsers: the contract (`base`) and the built-in parsers, registered by
`builtin` through the same hook as a third party's."""
