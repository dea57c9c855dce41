"""The engine side: the step loop (core), scheduling, the model runner and its attention, sampling, speculation, detokenizing."""
