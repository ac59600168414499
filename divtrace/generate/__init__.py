"""Generation: greedy decoding of prompts in a batch and alone, compared step by step."""
