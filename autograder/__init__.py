"""The fastdl-lab autograder: course build, trusted grading engine and CLI (python -m autograder)."""
