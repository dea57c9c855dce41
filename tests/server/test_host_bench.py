"""bench.host (issue 47's host bar) runs the engine as a GPU runs it, its replay stubbed: the
greedy rows' steps replay a graph and launch the next step ahead; the sampler's ways replay one
step after the other. It broke once unnoticed when the runner's forward grew a keyword."""

from bench import host
from bench.architectures import tokenizer


def test_each_way_steps_through_the_stubbed_replay():
    tok = tokenizer()
    for way in host.WAYS:
        median, mean, engine = host.measure(tok, 2, 6, way)
        assert median > 0 and mean > 0
        assert engine.runner.graphs.replayed >= 6, way  # decode steps replayed a (stand-in) graph
        assert engine.runner.paths["overlap"] == ("on" if way == "now" else "off"), way
