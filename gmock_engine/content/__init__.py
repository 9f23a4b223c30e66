"""What a request's tokens are: token sources, the tokenizer, structured outputs, tool calls and reasoning, logprobs, pooling, speculative decoding. Pure."""
