from moorage.cli import main

main()
