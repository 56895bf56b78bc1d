"""Hidden tests of chapter 00: graded like the others, never copied into a learner workspace
(``labkit workspace`` leaves ``tests/grading/hidden`` out; ``labkit autograder`` puts it back
in the bundle, where Gradescope shows them once grades are published).

An instructor adds a hidden test by writing it here, in ``tests/grading/hidden/test_<module>.py``,
with ``@task`` as anywhere else. This one: a ring over a group whose ranks are not
consecutive (global ranks 0 and 2 of 3), where "my neighbour is my rank + 1" is wrong.
"""

from labkit.course.grading import run_graded, task
from tests.grading.test_collectives import all_reduce_on_rank


@task("collectives.all_reduce", points=1)
def test_all_reduce_on_a_group_with_a_gap():
    run_graded("collectives.all_reduce", all_reduce_on_rank, 3, [0, 2])
