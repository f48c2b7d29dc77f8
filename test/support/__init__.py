"""What several test files share: paths, node processes, launch, models, robots. Fixtures
are in the conftest.py files; these are the plain functions and classes they and the tests
import."""
