from shmctl.app import run

run()
