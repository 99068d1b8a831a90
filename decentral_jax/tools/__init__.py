"""Tools: the command lines and the main job, on top of the library."""
