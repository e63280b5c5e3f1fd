"""Load FlyDSL's pytest plugin for this suite: the ``gpu`` marker, the ``device``
fixture, ``--require-gpu``, and ``import flydsl`` before any test module imports
Triton. Installing FlyDSL does not load it into other projects' test runs."""

pytest_plugins = ["flydsl.testing.plugin"]
