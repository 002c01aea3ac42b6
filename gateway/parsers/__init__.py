"""Reading structure out of generated text: tool calls (`tool_calls`, one module per
model family's format, `registry` by name) and structured outputs' grammars."""
