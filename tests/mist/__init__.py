"""Tests of mist."""
