"""python -m kareus.cli"""

from kareus.cli import main

main()
