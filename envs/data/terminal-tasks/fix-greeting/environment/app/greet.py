import sys
print('Hello, ' + sys.argv[0] + '!')
