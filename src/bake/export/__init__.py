"""What ships: the physically smaller model, its GGUF form for llama.cpp, the task-trimmed
vocabulary, the model card, and the artifact read back the way a user loads it."""
