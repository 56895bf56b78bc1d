import pytest

from labkit.course.workspace import is_student_workspace

pytest_plugins = ["labkit.course.grading"]

# Tests that exercise the reference solutions (not the infrastructure) skip in a learner
# workspace, where those solutions are stubs; the infrastructure tests run in both trees.
needs_solutions = pytest.mark.skipif(is_student_workspace(), reason="needs the reference solutions")
