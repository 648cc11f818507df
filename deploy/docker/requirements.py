"""Print the project's dependencies, and those of the extras named on the command line, one a line, from
pyproject.toml (a requirements file): the image build installs them in a layer of their own, before the source, so
that a change of the code alone reinstalls none of them. It reads pyproject.toml; it installs nothing."""

import sys
import tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
extras = [requirement for extra in sys.argv[2:] for requirement in project["optional-dependencies"][extra]]
print("\n".join([*project["dependencies"], *extras]))
