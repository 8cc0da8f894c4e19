"""The dataset tools' progress lines (not a terminal): one per 5% and at the end, the
time left measured from the first call (a resumed run's skipped work is not speed)."""

from pycls_fast.datasets.formats.progress import progress_printer


def test_a_line_every_five_percent_and_at_the_end(capsys):
    update = progress_printer("packing train", "image")
    for done in range(40, 101):  # resumed at 40 of 100
        update(done, 100)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "packing train: 40/100 images, timing..."
    assert lines[-1].startswith("packing train: 100/100 images, ~0 s left")
    assert len(lines) == 1 + (100 - 40) // 5
