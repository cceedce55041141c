// One file written through Hadoop's client (FileSystem or FileContext, as Spark's checkpoint
// file manager does) with a pause in the middle of its body, for tests/test_ride_through.py:
//
//   java -cp CLASSES:JARS/*[:RIDE_JAR] RideHarness fs|fc URI SIZE KEY=VALUE...
//
// Creates URI (overwrite), writes SIZE/2 bytes, flushes them to the gateway, prints "MID" and
// waits for a line on stdin (the test kills the gateway meanwhile), writes the rest, closes,
// then reads the file back and prints "VERIFIED" if it holds exactly the bytes written, or
// "MISMATCH"; an exception goes to stderr and the exit code is 1. The bytes: i % 251.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.net.URI;
import java.util.EnumSet;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.CreateFlag;
import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileContext;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Options;
import org.apache.hadoop.fs.Path;

public class RideHarness {
    public static void main(String[] args) throws Exception {
        String mode = args[0];
        URI uri = new URI(args[1]);
        int size = Integer.parseInt(args[2]);
        Configuration conf = new Configuration();
        for (int i = 3; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            conf.set(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        byte[] data = new byte[size];
        for (int i = 0; i < size; i++) {
            data[i] = (byte) (i % 251);
        }
        Path path = new Path(uri);
        FileSystem fs = FileSystem.get(uri, conf);
        System.out.println("FS " + fs.getClass().getName());
        FSDataOutputStream out = mode.equals("fc")
                ? FileContext.getFileContext(uri, conf).create(path, EnumSet.of(CreateFlag.CREATE, CreateFlag.OVERWRITE),
                        Options.CreateOpts.createParent())
                : fs.create(path, true);
        int half = size / 2;
        out.write(data, 0, half);
        out.flush();
        System.out.println("MID");
        System.out.flush();
        new BufferedReader(new InputStreamReader(System.in)).readLine();
        // in pieces, so a dead connection shows on a write as well as at close
        for (int off = half; off < size; off += 8192) {
            out.write(data, off, Math.min(8192, size - off));
        }
        out.close();
        System.out.println("CLOSED");
        byte[] back = new byte[size + 1];
        int n = 0;
        try (FSDataInputStream in = fs.open(path)) {
            for (int r; n < back.length && (r = in.read(back, n, back.length - n)) > 0; ) {
                n += r;
            }
        }
        boolean same = n == size;
        for (int i = 0; same && i < size; i++) {
            same = back[i] == data[i];
        }
        System.out.println(same ? "VERIFIED" : "MISMATCH " + n);
        try {
            Class<?> ride = Class.forName("sos.hadoop.RideThroughWebHdfsFileSystem");
            System.out.println("FAILURES " + ride.getMethod("bodyFailures").invoke(null));
            System.out.println("RESENT " + ride.getMethod("resentBodies").invoke(null));
        } catch (ClassNotFoundException e) {
            System.out.println("RESENT none");
        }
    }
}
