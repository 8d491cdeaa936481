"""edgellm: compile small language models into verified artifacts and run them on the device."""

__version__ = "0.1.0"
