"""kvdepotd: the kvdepot daemon."""
