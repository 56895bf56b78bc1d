"""The shared figures build without a display, and the timeline keeps labels apart."""

import matplotlib

matplotlib.use("Agg")

from matplotlib.colors import to_rgba  # noqa: E402

from labkit import viz  # noqa: E402


def test_timeline_never_gives_two_labels_one_colour():
    fig = viz.plot_timeline([(0, 0, 1, "a"), (0, 1, 2, "b"), (1, 0, 2, "c")], colors={"a": "C0"})
    faces = {tuple(p.get_facecolor()) for p in fig.axes[0].patches if p.get_width() > 0}
    assert len(faces) == 3, f"three labels drawn with {len(faces)} colours"
    assert to_rgba("C0") in faces, "the colour fixed by the caller was not used"


def test_ring_schedule_sends_every_chunk_around_the_ring():
    for n in (2, 3, 4):
        steps = viz.ring_schedule(n)
        assert len(steps) == 2 * (n - 1)
        for _, _, sends in steps:
            assert sorted(src for src, _, _ in sends) == list(range(n))
            assert all(dst == (src + 1) % n for src, dst, _ in sends)
        figure = viz.plot_ring_steps(n)
        assert figure.axes
